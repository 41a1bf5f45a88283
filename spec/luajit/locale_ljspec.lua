-- Machine-read text under a locale whose decimal point is a comma, under
-- LuaJIT: the specs are spec/support/locale.lua's.
local helper = require "spec.luajit.helper"

require("spec.support.locale")(helper, {
  describe = describe, it = it, setup = setup, teardown = teardown,
  pending = pending, assert = assert,
})
