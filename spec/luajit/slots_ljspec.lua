-- Name slots under LuaJIT, on the FFI and the classic paths: the specs
-- are spec/support/slots.lua's.
local helper = require "spec.luajit.helper"

require("spec.support.slots")(helper, helper.paths, helper.use, {
  describe = describe, it = it, before_each = before_each, after_each = after_each,
  assert = assert,
})
