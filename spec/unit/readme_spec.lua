-- The README's synopsis is code users paste first: it must run as shown.
local helper = require "spec.support.helper"

describe("README.md", function()
  it("has a synopsis that runs and prints what its comments say", function()
    local f = assert(io.open("README.md"))
    local text = f:read("a")
    f:close()
    local code = assert(text:match("```lua\n(local tally = require \"tally\".-)```"),
                        "no synopsis block found")
    local path = helper.tmpfile("readme") -- a fresh store instead of /tmp/counters.tly
    code = code:gsub("file:/tmp/counters%.tly", "file:" .. path)
    local out = {}
    local env = setmetatable({ print = function(...)
      local parts = table.pack(...)
      for i = 1, parts.n do parts[i] = tostring(parts[i]) end
      out[#out + 1] = table.concat(parts, "\t")
    end }, { __index = _G })
    assert(load(code, "=synopsis", "t", env))()
    assert.same({ "6", "6\t1" }, out)
  end)
end)
