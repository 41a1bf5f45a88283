-- tally.cmd.repl: what the tally prompt shows and completes (src/cli/cli_repl.c
-- reads the lines and calls these).
--
-- Runs only under the `tally` command, which is Lua 5.4 (it uses
-- tally.term, preloaded by the command); never loaded by require "tally",
-- so the LuaJIT build does not need it.
--
--   show(...)                   -> text: the values, tab-separated, tables
--                                  pretty-printed (nested, keys sorted,
--                                  cycles marked, long tables cut short),
--                                  counters and stores described
--   complete(line, start, text, quote) -> { candidates }, kind
--                                  line is the input up to the cursor, text
--                                  the word being completed (from byte
--                                  start, 0-based), quote the open quote if
--                                  the word is in a string; kind "files"
--                                  lets readline complete file names
--   banner()                    -> the greeting

local tally = require "tally"
local printable = require("tally.cmd.common").printable   -- names: control bytes as \xNN

local type, pairs, ipairs, next, tostring, pcall, select, rawget =
      type, pairs, ipairs, next, tostring, pcall, select, rawget
local getmetatable = debug.getmetatable
local fmt, rep = string.format, string.rep
local concat, sort = table.concat, table.sort
local mtype = math.type

local _M = {}

local MAX_ITEMS = 50        -- entries shown per table
local MAX_DEPTH = 6         -- nesting shown
local MAX_TOTAL = 2000      -- entries shown per value, over all its tables
local MAX_SHARDS = 32       -- shard values shown for a counter
local MAX_LISTED = 20       -- a store lists its counters up to this many

local function width()
  local ok, term = pcall(require, "tally.term")
  if ok and term.isatty(1) then
    local cols = term.size()
    if cols >= 20 then return cols end
  end
  return 80
end

-- ---- names --------------------------------------------------------------

local KEYWORDS = {}
for w in ([[and break do else elseif end false for function goto if in
            local nil not or repeat return then true until while]]):gmatch("%a+") do
  KEYWORDS[w] = true
end

local function is_ident(s)
  return type(s) == "string" and s:find("^[%a_][%w_]*$") ~= nil and not KEYWORDS[s]
end

local function kind_of(v)
  local mt = getmetatable(v)
  local name = type(mt) == "table" and rawget(mt, "__name")
  if name == "tally.counter" then return "counter" end
  if name == "tally.store" then return "store" end
  return type(v)
end

-- ---- values --------------------------------------------------------------

local ESC = { ["\n"] = "\\n", ["\t"] = "\\t", ["\r"] = "\\r", ['"'] = '\\"', ["\\"] = "\\\\" }
-- A string as Lua source that reads back as the same bytes, and cannot
-- drive the terminal: the quote, the backslash and the common controls as
-- Lua writes them, then the rule of every name shown (util.printable):
-- other controls, bytes outside valid UTF-8 and UTF-8's C1 controls
-- (U+0080-U+009F: CSI is one) as \xNN, which Lua reads back.
local function quote(s)
  return '"' .. printable((s:gsub('[\n\t\r"\\]', ESC))) .. '"'
end

local function when(at)
  local t = math.floor(at)
  if os.date("%Y-%m-%d", t) == os.date("%Y-%m-%d") then return os.date("%H:%M:%S", t) end
  return os.date("%Y-%m-%d %H:%M:%S", t)
end

local function num(x)
  if mtype(x) == "float" and x == math.floor(x) and x > -1e15 and x < 1e15 then
    return fmt("%d", x)
  end
  if mtype(x) == "float" then return fmt("%.4g", x) end
  return tostring(x)
end

-- "tally.counter 'x' = 6" (inline), or with shards and the rollup (block).
local function counter_text(c, block)
  local ok, info = pcall(c.info, c)
  if not ok or not info then return tostring(c) end
  local v, msg = c:value()
  if v == nil then
    if msg and msg:find("dropped") then return fmt("tally.counter '%s' (dropped)", printable(info.name)) end
    return fmt("tally.counter '%s' (%s)", printable(info.name), tostring(msg))
  end
  local head = fmt("tally.counter '%s' = %s", printable(info.name), tostring(v))
  if not block then return head end
  local lines = { head .. fmt("  (%d%s shards, %s)", info.shards, info.auto and " auto" or "",
                              info.policy) }
  local shards = c:shards()
  if shards then
    local parts = {}
    for i = 1, math.min(#shards, MAX_SHARDS) do parts[i] = tostring(shards[i]) end
    if #shards > MAX_SHARDS then parts[#parts + 1] = fmt("... (%d more)", #shards - MAX_SHARDS) end
    lines[#lines + 1] = "  shards: " .. concat(parts, " ")
  end
  local r = c:rolled()
  if r then
    lines[#lines + 1] = fmt("  rolled: %s at %s (%s%s, %s/s)", tostring(r.value), when(r.at),
                            r.delta >= 0 and "+" or "", tostring(r.delta), num(r.rate))
  end
  return concat(lines, "\n")
end

local function store_text(db, block)
  local ok, st = pcall(db.stats, db)
  if not ok or not st then return tostring(db) end
  local head = fmt("%s: %d counter%s", tostring(db), st.counters, st.counters == 1 and "" or "s")
  if not block then return head end
  local lines = { head }
  if st.counters > 0 and st.counters <= MAX_LISTED then
    local names = db:names()
    local w = 0
    for _, n in ipairs(names) do if #printable(n) > w then w = #printable(n) end end
    for _, n in ipairs(names) do
      local v = db:value(n)
      lines[#lines + 1] = fmt("  %-" .. w .. "s  %s", printable(n), v ~= nil and tostring(v) or "-")
    end
  elseif st.counters > MAX_LISTED then
    lines[#lines + 1] = "  (db:names() lists them; tally ls from a shell)"
  end
  return concat(lines, "\n")
end

-- Keys in a stable order: numbers, then strings, then the rest.
local ORDER = { number = 1, string = 2, boolean = 3 }
local function key_less(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return (ORDER[ta] or 9) < (ORDER[tb] or 9) end
  if ta == "number" or ta == "string" then return a < b end
  return tostring(a) < tostring(b)
end

-- A pretty-printer for one value. ctx: { path = tables being printed,
-- ids = cycle targets' numbers, nid, total = entries so far, width }.
local render

local function render_key(k, ctx)
  if is_ident(k) then return k end
  if type(k) == "string" then return "[" .. quote(k) .. "]" end
  if type(k) == "number" then return "[" .. num(k) .. "]" end
  return "[" .. render(k, ctx, 0, true) .. "]"
end

local function render_table(t, ctx, indent)
  if ctx.path[t] then
    if not ctx.ids[t] then ctx.nid = ctx.nid + 1; ctx.ids[t] = ctx.nid end
    return fmt("<cycle %d>", ctx.ids[t])
  end
  if ctx.depth >= MAX_DEPTH then return "{...}" end
  ctx.path[t] = true
  ctx.depth = ctx.depth + 1
  local items, n, shown = {}, 0, 0
  local limit = MAX_ITEMS
  local seq = 0
  while rawget(t, seq + 1) ~= nil do seq = seq + 1 end
  local keys = {}
  for k in next, t do
    if not (mtype(k) == "integer" and k >= 1 and k <= seq) then keys[#keys + 1] = k end
  end
  local total = seq + #keys
  for i = 1, seq do
    if shown >= limit or ctx.total >= MAX_TOTAL then break end
    n = n + 1; shown = shown + 1; ctx.total = ctx.total + 1
    items[n] = render(rawget(t, i), ctx, indent + 2, true)
  end
  if shown < limit and ctx.total < MAX_TOTAL then
    sort(keys, key_less)
    for _, k in ipairs(keys) do
      if shown >= limit or ctx.total >= MAX_TOTAL then break end
      n = n + 1; shown = shown + 1; ctx.total = ctx.total + 1
      items[n] = render_key(k, ctx) .. " = " .. render(rawget(t, k), ctx, indent + 2, true)
    end
  end
  if shown < total then items[n + 1] = fmt("... (%d more)", total - shown) end
  ctx.path[t] = nil
  ctx.depth = ctx.depth - 1
  local out
  if #items == 0 then
    out = "{}"
  else
    local line = "{ " .. concat(items, ", ") .. " }"
    if indent + #line <= ctx.width and not line:find("\n", 1, true) then
      out = line
    else
      -- one entry per line; runs of short array items share lines
      local pad = rep(" ", indent + 2)
      local lines, cur = {}, nil
      for i, item in ipairs(items) do
        local short = i <= seq and #item <= 24 and not item:find("\n", 1, true)
        if short and cur and #pad + #cur + #item + 2 <= ctx.width then
          cur = cur .. " " .. item .. ","
        else
          if cur then lines[#lines + 1] = cur end
          cur = item .. ","
          if not short then lines[#lines + 1] = cur; cur = nil end
        end
      end
      if cur then lines[#lines + 1] = cur end
      lines[#lines] = lines[#lines]:sub(1, -2)       -- no comma after the last
      out = "{\n" .. pad .. concat(lines, "\n" .. pad) .. "\n" .. rep(" ", indent) .. "}"
    end
  end
  if ctx.ids[t] then out = fmt("<%d>", ctx.ids[t]) .. out end
  return out
end

function render(v, ctx, indent, inner)
  local k = kind_of(v)
  if k == "string" then return inner and quote(v) or v end
  if k == "number" then return tostring(v) end
  if k == "counter" then return counter_text(v, not inner) end
  if k == "store" then return store_text(v, not inner) end
  if k == "table" then
    local mt = getmetatable(v)
    if type(mt) == "table" and rawget(mt, "__tostring") then
      local ok, s = pcall(tostring, v)
      if ok then return s end
    end
    return render_table(v, ctx, indent)
  end
  local ok, s = pcall(tostring, v)
  return ok and s or type(v)
end

-- show(...): the values as the prompt prints them.
function _M.show(...)
  local n = select("#", ...)
  local ctx = { path = {}, ids = {}, nid = 0, total = 0, depth = 0, width = width() }
  local out = {}
  for i = 1, n do
    local v = select(i, ...)
    out[i] = render(v, ctx, 0, false)
  end
  return concat(out, "\t")
end

_M.quote = quote

-- ---- completion ------------------------------------------------------------

-- t[k] without calling metamethods: raw fields, then __index tables.
local function peek_field(t, k)
  for _ = 1, 16 do
    if type(t) == "table" then
      local v = rawget(t, k)
      if v ~= nil then return v end
    end
    local mt = getmetatable(t)
    local idx = type(mt) == "table" and rawget(mt, "__index")
    if type(idx) ~= "table" then return nil end
    t = idx
  end
end

-- The value of a dotted path of names (`a.b.c`) in the globals, or nil.
local function resolve(path)
  local v = _G
  for part in path:gmatch("[^%.]+") do
    if not is_ident(part) then return nil end
    v = peek_field(v, part)
    if v == nil then return nil end
  end
  return v
end

-- Field names of v (and of its __index tables) that start with prefix;
-- only callable ones for `:`; names starting with "_" only if prefix does.
local function fields(v, methods, prefix)
  local out, seen = {}, {}
  local private = prefix:sub(1, 1) == "_"
  for _ = 1, 16 do
    if type(v) == "table" then
      for k, x in next, v do
        if is_ident(k) and not seen[k] and k:sub(1, #prefix) == prefix
           and (private or k:sub(1, 1) ~= "_") then
          local callable = type(x) == "function" or
                           (type(getmetatable(x)) == "table" and rawget(getmetatable(x), "__call"))
          if not methods or callable then
            seen[k] = true
            out[#out + 1] = k
          end
        end
      end
    end
    local mt = getmetatable(v)
    local idx = type(mt) == "table" and rawget(mt, "__index")
    if type(idx) ~= "table" then break end
    v = idx
  end
  return out
end

local function counter_names(db, prefix)
  local pattern
  if not prefix:find("[%*%?]") then pattern = prefix .. "*" end
  local ok, names = pcall(db.names, db, pattern)
  if not ok or type(names) ~= "table" then return {} end
  local out = {}
  for _, n in ipairs(names) do
    if n:sub(1, #prefix) == prefix then out[#out + 1] = n end
  end
  return out
end

function _M.complete(line, start, text, quote_char)
  local before = line:sub(1, start)
  if quote_char then
    -- in a string: the first argument of a store's method (db:counter("po)?
    local call = before:sub(1, -2)
    local obj = call:match("([%a_][%w_%.]*)%s*:%s*[%a_][%w_]*%s*%(%s*$")
    if obj then
      local db = resolve(obj)
      if kind_of(db) == "store" then return counter_names(db, text), "names" end
    end
    return {}, "files"
  end
  local head, sep = before:match("^(.-)%s*([%.:])%s*$")
  if sep and not head:find("%.$") then
    local path = head:match("([%a_][%w_%.]*)$")
    local lead = path and head:sub(1, #head - #path)
    if not path or lead:find("[%.:]%s*$") or path:find("%.$") then return {} end
    local obj = resolve(path)
    if obj == nil then return {} end
    return fields(obj, sep == ":", text), "fields"
  end
  if before:find("[%w_]$") then return {} end  -- after a number or a name: nothing
  local out = {}
  for w in pairs(KEYWORDS) do
    if w:sub(1, #text) == text then out[#out + 1] = w end
  end
  for _, k in ipairs(fields(_G, false, text)) do out[#out + 1] = k end
  return out, "globals"
end

-- ---- banner --------------------------------------------------------------------

function _M.banner()
  local db = rawget(_G, "db")
  local where = kind_of(db) == "store" and tostring(db):match("%((.*)%)") or "none"
  return fmt("tally %s (%s). 'tally' is the module, 'db' the store (%s).\n"
             .. "Tab completes, Ctrl-C cancels the line, Ctrl-D leaves.\n",
             tally.version, _VERSION, where)
end

return _M
