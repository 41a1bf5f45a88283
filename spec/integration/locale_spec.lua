-- Machine-read text under a locale whose decimal point is a comma, under
-- Lua 5.4: the specs are spec/support/locale.lua's.
local helper = require "spec.support.helper"

require("spec.support.locale")(helper, {
  describe = describe, it = it, setup = setup, teardown = teardown,
  pending = pending, assert = assert,
})
