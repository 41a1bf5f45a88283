-- tally.json.twice on a large document under Lua 5.4: the specs are
-- spec/support/json_twice.lua's.
local helper = require "spec.support.helper"

require("spec.support.json_twice")(helper, { describe = describe, it = it, assert = assert })
