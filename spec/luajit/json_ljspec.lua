-- tally.json.twice on a large document under LuaJIT: the specs are
-- spec/support/json_twice.lua's.
local helper = require "spec.luajit.helper"

require("spec.support.json_twice")(helper, { describe = describe, it = it, assert = assert })
