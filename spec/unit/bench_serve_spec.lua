-- spec/unit/bench_serve_spec.lua: the analysis of scripts/bench-serve's windows
-- (bench/serve_windows.lua), on made-up notes of the two writers.
local helper = require "spec.support.helper"
local q = helper.q

-- Both writers' notes every 50 ms over 0..35 s, at 1000 increments a
-- second but in the windows of rates (from, to, rate); the windows file
-- from wins ({ what, start, end }). Runs the analysis: output, exit code.
local function analyse(rates, wins)
  local lines = {}
  local n = 0
  for i = 0, 700 do
    local t = i * 0.05
    lines[#lines + 1] = string.format("%.4f %d", t, n)
    local r = 1000
    for _, w in ipairs(rates) do
      if t >= w[1] and t < w[2] then r = w[3] end
    end
    n = n + r * 0.05
  end
  local w1, w2, ws = helper.tmpfile("w1"), helper.tmpfile("w2"), helper.tmpfile("windows")
  helper.write(w1, table.concat(lines, "\n") .. "\n")
  helper.write(w2, table.concat(lines, "\n") .. "\n")
  local wl = {}
  for _, w in ipairs(wins) do wl[#wl + 1] = string.format("%s %.4f %.4f", w[1], w[2], w[3]) end
  helper.write(ws, table.concat(wl, "\n") .. "\n")
  return helper.sh("lua5.4 bench/serve_windows.lua " .. q(w1) .. " " .. q(w2) .. " " .. q(ws))
end

describe("bench-serve's windows", function()
  it("take each window's rate to the windows alone around it", function()
    local out, code = analyse({ { 5, 10, 500 }, { 15, 20, 900 }, { 25, 30, 600 } },
                              { { "alone", 0, 5 }, { "0", 5, 10 }, { "alone", 10, 15 }, { "19", 15, 20 },
                                { "alone", 20, 25 }, { "spin", 25, 30 }, { "alone", 30, 35 } })
    assert.equal(0, code, out)
    assert.matches("back to back: 50.0% of their rate alone (median of 1 rounds);", out, 1, true)
    assert.matches("at niceness 19 (a Prometheus elsewhere): 90.0%;", out, 1, true)
    assert.matches("never touches the store: 60.0%", out, 1, true)
    assert.matches("(the writers alone: 2000 to 2000 incr/s)", out, 1, true)
  end)

  it("fail, saying so, for a window with fewer than 2 notes after its first second", function()
    -- 1.04 s: one note after the first second (none at all in 0.99 s)
    for _, len in ipairs({ 1.04, 0.99 }) do
      local wins = {}
      for i, what in ipairs({ "alone", "0", "alone", "19", "alone", "spin", "alone" }) do
        wins[i] = { what, 2 * i, 2 * i + len }
      end
      local out, code = analyse({}, wins)
      assert.equal(1, code, out)
      assert.matches("^bench%-serve: writer 1 noted fewer than 2 counts in the %-?0%.0%d s of the "
                     .. "window 'alone' after its first second %(SECS too small, or the writer "
                     .. "stopped%)\n$", out)
    end
  end)
end)
