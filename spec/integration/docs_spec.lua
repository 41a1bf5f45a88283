-- Every code block of the documentation runs as written.
--
-- README.md and docs/*.md are read; each fenced block tagged `lua`, `sh` or
-- `nginx` is run (untagged blocks are sample output, not code):
--   lua    by the tally command as a script, with the globals it gives a
--          script run with --store: `tally` and `db` (a fresh file store),
--          as at the prompt; it must exit 0.
--   sh     by bash -e from the repository root, with build/bin on PATH; it
--          must exit 0. Servers it starts are found from their pid files
--          and stopped.
--   nginx  written to a prefix and started (a real nginx with the Lua
--          module, loading the LuaJIT build of tally): it must serve on its
--          `listen` port, count /page/1, show it at /metrics, and keep its
--          pid file in the prefix.
-- Paths under /tmp/, /var/lib/app/ and /var/log/app/ go to a private
-- directory, /opt/tally/ to the build's LuaJIT tree, and port 8080 to a free
-- port; nothing else in a block is changed. A block right after a line
-- `<!-- doc: skip: REASON -->` is not run (it is listed with its reason), and
-- `<!-- doc: root -->` marks a block that needs root (skipped otherwise).
local helper = require "spec.support.helper"
local peers = require "spec.support.peers"

local q = helper.q

local slurp = helper.slurp

-- The documentation files: README.md, then docs/*.md in name order.
local function doc_files()
  local files = { "README.md" }
  local out = helper.sh('for f in docs/*.md; do [ -e "$f" ] && echo "$f"; done; true')
  for path in out:gmatch("[^\n]+") do files[#files + 1] = path end
  return files
end

-- The fenced blocks of one markdown text: { {lang=, code=, line=, skip=, root=} }.
-- Fences may be indented (blocks inside list items); the indent is removed.
local function blocks_of(text)
  local list, cur, marker = {}, nil, nil
  local n = 0
  for line in (text .. "\n"):gmatch("(.-)\n") do
    n = n + 1
    if cur then
      if line:match("^%s*```%s*$") then
        cur.code = table.concat(cur.lines, "\n") .. "\n"
        list[#list + 1] = cur
        cur = nil
      else
        cur.lines[#cur.lines + 1] = line:sub(1, #cur.indent) == cur.indent
                                    and line:sub(#cur.indent + 1) or line
      end
    else
      local indent, lang = line:match("^(%s*)```(%S*)%s*$")
      if indent then
        cur = { lang = lang, line = n, indent = indent, lines = {} }
        if marker then
          cur.skip = marker:match("^skip:%s*(.-)%s*$")
          cur.root = marker == "root"
        end
        marker = nil
      elseif line:match("%S") then
        marker = line:match("^%s*<!%-%- doc: (.-) %-%->%s*$")
      end
    end
  end
  return list
end

local RUN = { lua = true, sh = true, nginx = true }

describe("the documentation's code blocks", function()
  local dir, port

  local function localize(code)
    code = code:gsub("/tmp/", dir .. "/tmp/")
               :gsub("/var/lib/app/", dir .. "/var/lib/app/")
               :gsub("/var/log/app/", dir .. "/var/log/app/")
               :gsub("/opt/tally/", helper.build .. "/luajit/")
               :gsub("/opt/tally", helper.build .. "/luajit")
               :gsub("([:%s])8080([%s;/])", "%1" .. port .. "%2")
    return code
  end

  -- Wait (5 s at most) until pid is gone or a zombie. Tools run without
  -- LD_PRELOAD: a sanitizer runtime would add its own lines to their output.
  local function wait_gone(pid)
    for _ = 1, 50 do
      local st = helper.sh("env -u LD_PRELOAD ps -o stat= -p " .. pid)
      if st == "" or st:match("Z") then return end
      os.execute("sleep 0.1")
    end
  end

  -- Stop what a block started: every nginx whose pid file is under dir.
  local function stop_servers()
    local files = helper.sh("env -u LD_PRELOAD sh -c 'ls " .. q(dir) .. "/tmp/*/logs/nginx.pid' 2>/dev/null")
    for path in files:gmatch("[^\n]+") do
      local pid = (slurp(path) or ""):match("^%s*(%d+)%s*$")
      if pid then
        os.execute("kill -QUIT " .. pid .. " 2>/dev/null")
        wait_gone(pid)
      end
    end
  end

  local run = {}

  function run.lua(code)
    local path = dir .. "/block.lua"
    helper.write(path, code)
    local out, status = helper.sh(("cd %s && %s --store %s --create %s"):format(
      q(dir), q(helper.bin), q("file:" .. dir .. "/docs.tly"), q(path)))
    return status == 0, out
  end

  function run.sh(code)
    -- the build tree the suite runs in, wherever the block says build/
    code = ("\n" .. code):gsub("%$PWD/build/", helper.build .. "/")
                           :gsub("([%s\"'=;(])build/", "%1" .. helper.build .. "/")
    -- a config file the block starts nginx with gets the same port
    code = code:gsub('"?%$PWD/(examples/[%w_/%-]+%.conf)"?', function(conf)
      local copy = dir .. "/" .. conf:gsub("/", "_")
      helper.write(copy, localize(assert(slurp(conf))))
      return q(copy)
    end)
    local path = dir .. "/block.sh"
    helper.write(path, "set -e\n" .. code)
    local bin = helper.bin:match("^(.*)/[^/]*$")
    -- output to a file, not a pipe: a server the block leaves in the
    -- background would hold a pipe open
    local log = dir .. "/block.out"
    local _, status = helper.sh(("PATH=%s:$PATH timeout 120 bash %s >%s 2>&1 </dev/null"):format(
      q(bin), q(path), q(log)))
    stop_servers()
    return status == 0, slurp(log) or ""
  end

  -- Started for real: it must serve on its own `listen` port, count a
  -- request, show it at /metrics and keep its pid file in its prefix.
  function run.nginx(code)
    local prefix = dir .. "/nginx"
    os.execute(("mkdir -p %s/conf %s/logs %s/data"):format(q(prefix), q(prefix), q(prefix)))
    os.execute("chown nobody " .. q(prefix .. "/data") .. " 2>/dev/null")
    helper.write(prefix .. "/conf/nginx.conf", code)
    local pid = helper.sh(("nginx -p %s -c conf/nginx.conf -e logs/error.log -g 'daemon off;' >%s 2>&1 </dev/null & echo $!")
      :format(q(prefix), q(prefix .. "/logs/stdout"))):match("(%d+)%s*$")  -- the last line: $!
    local url = "http://127.0.0.1:" .. port
    local ok, why = false, "no answer on " .. url
    for _ = 1, 50 do
      local _, code1 = helper.sh("env -u LD_PRELOAD curl -s -m 5 -o /dev/null " .. url .. "/page/1")
      if code1 == 0 then
        local metrics = helper.sh("env -u LD_PRELOAD curl -s -m 5 " .. url .. "/metrics")
        ok = metrics:find('path="/page/1"', 1, true) ~= nil
        why = "/metrics does not show the request:\n" .. metrics
        break
      end
      os.execute("sleep 0.1")
    end
    local pidfile = slurp(prefix .. "/logs/nginx.pid")
    if ok and not pidfile then ok, why = false, "no pid file in the prefix (logs/nginx.pid)" end
    if pid then
      os.execute("kill -QUIT " .. pid .. " 2>/dev/null")
      wait_gone(pid)
    end
    return ok, why .. "\n" .. (slurp(prefix .. "/logs/stdout") or "") .. (slurp(prefix .. "/logs/error.log") or "")
  end

  for _, file in ipairs(doc_files()) do
    describe(file, function()
      for _, b in ipairs(blocks_of(assert(slurp(file)))) do
        if RUN[b.lang] then
          local title = ("%s block at line %d"):format(b.lang, b.line)
          if b.skip then
            pending(title .. " (not run: " .. b.skip .. ")")
          elseif b.root and not helper.is_root() then
            pending(title .. " (needs root)")
          elseif b.lang == "sh" and os.getenv("LD_PRELOAD") then
            -- a sanitizer build: its runtime, preloaded for what the block
            -- starts, makes curl hang; the plain build runs these blocks
            pending(title .. " (sanitizer build: run by the plain build)")
          else
            it("runs the " .. title, function()
              dir = helper.tmpfile("docs")
              os.execute("mkdir -p " .. q(dir .. "/tmp") .. " " .. q(dir .. "/var/lib/app")
                         .. " " .. q(dir .. "/var/log/app"))
              port = peers.free_port()
              local ok, out = run[b.lang](localize(b.code))
              assert(ok, ("%s:%d: the block failed:\n%s\n--- output:\n%s"):format(
                file, b.line, localize(b.code), out))
            end)
          end
        end
      end
    end)
  end

  it("finds the blocks it runs (the parser is not silently empty)", function()
    local counts = {}
    for _, file in ipairs(doc_files()) do
      for _, b in ipairs(blocks_of(assert(slurp(file)))) do
        counts[b.lang] = (counts[b.lang] or 0) + 1
      end
    end
    assert.is_true((counts.lua or 0) >= 3)
    assert.is_true((counts.sh or 0) >= 2)
    assert.is_true((counts.nginx or 0) >= 1)
  end)
end)
