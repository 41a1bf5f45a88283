-- Name slots under Lua 5.4: the specs are spec/support/slots.lua's.
local helper = require "spec.support.helper"

require("spec.support.slots")(helper, { "classic" }, nil, {
  describe = describe, it = it, before_each = before_each, after_each = after_each,
  assert = assert,
})
