-- tally.openresty's scrape pause, outside nginx: a fake ngx counts the
-- sleeps it asks for while a loop burns CPU and pauses as a scrape does.
describe("tally.openresty's scrape pause", function()
  local saved, sleeps, yielder

  setup(function()
    saved = rawget(_G, "ngx")
    _G.ngx = { get_phase = function() return "init" end,
               sleep = function() sleeps = sleeps + 1 end }
    package.loaded["tally.openresty"] = nil
    yielder = require("tally.openresty")._yielder
  end)

  teardown(function()
    package.loaded["tally.openresty"] = nil
    _G.ngx = saved
  end)

  -- seconds of CPU time, pausing every microsecond or so
  local function work(seconds, pause)
    local t0, x = os.clock(), 0
    while os.clock() - t0 < seconds do
      for i = 1, 200 do x = x + i end
      pause()
    end
    return x
  end

  it("sleeps once 0.3 ms of work have passed since it last did", function()
    sleeps = 0
    work(0.03, yielder())
    assert.is_true(sleeps >= 50 and sleeps <= 100, "sleeps: " .. sleeps)
  end)

  it("goes on sleeping when the wall clock steps back", function()
    local tally = require "tally"
    local now, t = tally.now, 2e9
    tally.now = function() t = t - 1; return t end      -- stepped back at every read
    sleeps = 0
    local ok, err = pcall(work, 0.03, yielder())
    tally.now = now
    assert(ok, err)
    assert.is_true(sleeps >= 50, "sleeps: " .. sleeps)
  end)
end)
