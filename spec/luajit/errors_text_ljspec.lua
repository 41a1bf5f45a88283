-- The messages the Lua side builds, under LuaJIT: the specs are
-- spec/support/errors_text.lua's.
local helper = require "spec.luajit.helper"

require("spec.support.errors_text")(helper, {
  describe = describe, it = it, before_each = before_each, after_each = after_each,
  assert = assert,
})
