-- luacheck (Debian's lua-check); scripts/test runs it over every Lua file.
std = "max"
max_line_length = 130
exclude_files = { "build*/**" }
ignore = {
  "212/self",   -- methods keep their self even when one does not use it
  "311",        -- `x = nil` to free a big value early, `out, code = ...` step by step in specs
  "421", "431", -- shadowing a local in an inner block (msg, ok, c, json): kept where it reads best
  "581",        -- `not (x > y)` is how a NaN is refused: x <= y would let it pass
}
files["lua/tally/openresty.lua"] = { globals = { "ngx" } }
files["examples/openresty"] = { globals = { "ngx" } }
files["spec"] = { std = "+busted" }
files["spec"].max_line_length = false     -- expected messages are quoted whole
files["spec"].unused_args = false         -- callbacks keep the signature they are given
files["bench"] = { ignore = { "241", "211" } }  -- a table mutated to be measured, results kept for the reader
