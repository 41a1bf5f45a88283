-- tally.format: JSON, InfluxDB line protocol and Prometheus text for records.
local helper = require "spec.support.helper"
local tally = require "tally"
local cjson = require "cjson"

local err = helper.err
local format = tally.format
local prom = require "tally.prometheus"

local MAXI, MINI = math.maxinteger, math.mininteger
local AT = 1700000000.123

describe("tally.format", function()
  it("is the module tally.format", function()
    assert.equal(require "tally.format", format)
  end)

  describe(".json()", function()
    it("writes the fields in order, integers exactly, at with milliseconds", function()
      assert.equal('{"name":"post:1:likes","value":6,"at":1700000000.123,"delta":1,"rate":0.1}',
                   format.json({ name = "post:1:likes", value = 6, at = AT, delta = 1, rate = 0.1 }))
    end)

    it("writes every int64 exactly (cjson would round to 14 digits)", function()
      for _, v in ipairs({ MAXI, MINI, 1 << 62, -(1 << 62), (1 << 53) + 1, -((1 << 53) + 1) }) do
        local text = format.json({ name = "x", value = v, delta = v })
        assert.equal(string.format('{"name":"x","value":%d,"delta":%d}', v, v), text)
      end
      assert.equal('{"name":"x","value":5}', format.json({ name = "x", value = 5.0 }))
    end)

    it("writes at with exactly three decimals, rounded to the millisecond", function()
      local function at(t) return format.json({ name = "x", value = 0, at = t }):match('"at":([^,}]*)') end
      assert.equal("1700000000.123", at(AT))
      assert.equal("1700000000.000", at(1700000000))
      assert.equal("2.063", at(2.0625))
      assert.equal("0.500", at(0.5))
      assert.equal("-0.500", at(-0.5))
      assert.equal("-2.250", at(-2.25))
      assert.equal("0.001", at(0.001))
    end)

    it("writes rate with the fewest digits that read back, and null when not finite", function()
      local function rate(r) return format.json({ name = "x", value = 0, rate = r }):match('"rate":([^,}]*)') end
      assert.equal("0.1", rate(0.1))
      assert.equal("2.5", rate(2.5))
      assert.equal("3", rate(3))
      assert.equal(1 / 3, tonumber(rate(1 / 3)))
      assert.equal("1e+300", rate(1e300))
      assert.equal("null", rate(0 / 0))
      assert.equal("null", rate(math.huge))
      assert.equal("null", rate(-math.huge))
    end)

    it("leaves out at, delta and rate when absent", function()
      assert.equal('{"name":"x","value":-1}', format.json({ name = "x", value = -1 }))
    end)

    it("escapes names, and the text is JSON", function()
      local names = { 'q"uote', "back\\slash", "new\nline", "tab\tcr\r", "sp ace,comma=eq",
                      "slash/", "\1ctl\127", "unicode é ✓ 𝄞" }
      for _, name in ipairs(names) do
        local text = format.json({ name = name, value = 1, at = AT, delta = 0, rate = 0.5 })
        assert.is_nil(text:find("\n", 1, true))
        local back = cjson.decode(text)
        assert.equal(name, back.name)
        assert.equal(1, back.value)
        assert.equal(0.5, back.rate)
      end
    end)

    it("raises on records that are not records", function()
      assert.equal("bad argument #1 to 'json' (record must be a table, got nil)",
                   err(format.json, nil))
      assert.equal("bad argument #1 to 'json' (record.name must be a string, got 1)",
                   err(format.json, { name = 1, value = 1 }))
      assert.equal("bad argument #1 to 'json' (record.value must be an integer, got 1.5)",
                   err(format.json, { name = "x", value = 1.5 }))
      assert.equal("bad argument #1 to 'json' (record.value must be an integer, got nil)",
                   err(format.json, { name = "x" }))
      assert.equal("bad argument #1 to 'json' (record.delta must be an integer, got 'x')",
                   err(format.json, { name = "x", value = 1, delta = "x" }))
      assert.equal("bad argument #1 to 'json' (record.rate must be a number, got '1')",
                   err(format.json, { name = "x", value = 1, rate = "1" }))
      assert.equal("bad argument #1 to 'json' (record.at must be a finite number, got inf)",
                   err(format.json, { name = "x", value = 1, at = math.huge }))
    end)
  end)

  describe(".json_array()", function()
    it("writes an array of records", function()
      assert.equal("[]", format.json_array({}))
      assert.equal('[{"name":"a","value":1},{"name":"b","value":9223372036854775807}]',
                   format.json_array({ { name = "a", value = 1 }, { name = "b", value = MAXI } }))
    end)

    it("names the bad record", function()
      assert.equal("bad argument #1 to 'json_array' (records[2].value must be an integer, got 0.5)",
                   err(format.json_array, { { name = "a", value = 1 }, { name = "b", value = 0.5 } }))
      assert.equal("bad argument #1 to 'json_array' (table expected, got 'x')",
                   err(format.json_array, "x"))
    end)
  end)

  describe(".influx()", function()
    local rec = { name = "post:1:likes", value = 6, at = AT, delta = 1, rate = 0.1 }

    it("writes one line per record, in milliseconds by default", function()
      assert.equal("tally,name=post:1:likes value=6i,delta=1i,rate=0.1 1700000000123\n",
                   format.influx({ rec }))
      assert.equal("", format.influx({}))
      assert.equal("tally,name=a value=1i 1700000000123\ntally,name=b value=-2i,delta=-3i\n",
                   format.influx({ { name = "a", value = 1, at = AT }, { name = "b", value = -2, delta = -3 } }))
    end)

    it("writes the timestamp in the precision asked for", function()
      local function ts(p) return format.influx({ rec }, { precision = p }):match(" (%-?%d+)\n$") end
      assert.equal("1700000000", ts("s"))
      assert.equal("1700000000123", ts("ms"))
      assert.equal("1700000000123000", ts("u"))
      assert.equal("1700000000123000", ts("us"))
      assert.equal("1700000000123000000", ts("ns"))
      assert.equal("1700000000123000000", ts("n"))    -- InfluxDB 1.x's /write takes n
      assert.equal("28333333", ts("m"))
      assert.equal("472222", ts("h"))
    end)

    it("writes integers exactly and leaves out a rate that is not finite", function()
      assert.equal("tally,name=x value=9223372036854775807i,delta=-9223372036854775808i\n",
                   format.influx({ { name = "x", value = MAXI, delta = MINI, rate = 0 / 0 } }))
      assert.equal("tally,name=x value=4611686018427387904i,rate=1e+300\n",
                   format.influx({ { name = "x", value = 1 << 62, rate = 1e300 } }))
    end)

    it("escapes tag values and the measurement as line protocol requires", function()
      assert.equal("my\\ m\\,x=y,name=a\\ b\\,c\\=d\\e value=1i\n",
                   format.influx({ { name = "a b,c=d\\e", value = 1 } }, { measurement = "my m,x=y" }))
      assert.equal("tally,name=q\"uote✓ value=1i\n", format.influx({ { name = 'q"uote✓', value = 1 } }))
    end)

    it("raises on what line protocol cannot carry, and on bad options", function()
      assert.equal("bad argument #1 to 'influx' (records[1].name 'a\\x0ab' has a newline, which line protocol cannot carry in a tag)",
                   err(format.influx, { { name = "a\nb", value = 1 } }))
      assert.equal("bad argument #1 to 'influx' (records[1].name 'a\\' ends in a backslash, which line protocol cannot carry in a tag)",
                   err(format.influx, { { name = "a\\", value = 1 } }))
      assert.equal("bad argument #2 to 'influx' (precision must be 's', 'ms', 'u', 'ns', 'm' or 'h', got 'd')",
                   err(format.influx, { rec }, { precision = "d" }))
      assert.equal("bad argument #2 to 'influx' (unknown option 'db')",
                   err(format.influx, { rec }, { db = "x" }))
      assert.equal("bad argument #2 to 'influx' (measurement must be a non-empty string without newlines, got '')",
                   err(format.influx, { rec }, { measurement = "" }))
      -- a comment line; InfluxDB reads "m\\,x" as "m,x", "m\\=x" as "m=x"; a
      -- backslash at the end escapes the comma before the tags
      for _, m in ipairs({ "#m", "m\\", "m\\,x", "m\\ x", "m\\=x" }) do
        assert.equal("bad argument #2 to 'influx' (measurement " .. "'" .. m .. "'"
                     .. " cannot be carried by line protocol (it starts with #, ends in a "
                     .. "backslash, or has one before , space or =))",
                     err(format.influx, { rec }, { measurement = m }))
      end
      assert.equal("m#\\x,name=a value=1i\n",     -- elsewhere # and \ are as they are
                   format.influx({ { name = "a", value = 1 } }, { measurement = "m#\\x" }))
      assert.equal("bad argument #1 to 'influx' (records[1].value must be an integer, got 'x')",
                   err(format.influx, { { name = "a", value = "x" } }))
      assert.equal("bad argument #1 to 'influx' (records[1].at must be a finite number of seconds that fits, got 1e+300)",
                   err(format.influx, { { name = "a", value = 1, at = 1e300 } }, { precision = "ns" }))
    end)
  end)

  describe(".prometheus()", function()
    local DEFAULT = "# HELP tally_value Exact value of a tally counter (the sum of its shards), by counter name.\n"
                    .. "# TYPE tally_value gauge\n"

    it("puts counters without a mapping in tally_value{counter=...}, a gauge", function()
      assert.equal(DEFAULT .. 'tally_value{counter="a"} 1\ntally_value{counter="b"} -2\n',
                   format.prometheus({ { name = "b", value = -2 }, { name = "a", value = 1 } }))
      assert.equal("", format.prometheus({}))
    end)

    it("takes a table of values by name too (db:values())", function()
      assert.equal(DEFAULT .. 'tally_value{counter="a"} 1\ntally_value{counter="b"} 2\n',
                   format.prometheus({ a = 1, b = 2 }))
    end)

    it("writes integers exactly and floats as Prometheus spells them", function()
      assert.equal(DEFAULT .. 'tally_value{counter="a"} 9223372036854775807\n'
                   .. 'tally_value{counter="b"} -9223372036854775808\n'
                   .. 'tally_value{counter="c"} 0.25\ntally_value{counter="d"} NaN\n'
                   .. 'tally_value{counter="e"} +Inf\ntally_value{counter="f"} -Inf\n',
                   format.prometheus({ a = MAXI, b = MINI, c = 0.25, d = 0 / 0, e = math.huge,
                                       f = -math.huge }))
    end)

    it("escapes label values: backslash, double quote, newline", function()
      assert.equal(DEFAULT .. 'tally_value{counter="a\\"b\\\\c\\nd e,f=g é"} 1\n',
                   format.prometheus({ { name = 'a"b\\c\nd e,f=g é', value = 1 } }))
    end)

    it("never lets two counter names collide", function()
      local names = { "a:b", "a_b", "a b", "a.b", "a-b", "1ab", "_1ab", 'a"b', 'a\\"b', "a\\b",
                      "a\nb", "a\\nb", "x\255", "78ff", "\255", "ff" }
      local samples = {}
      for i, n in ipairs(names) do samples[i] = { name = n, value = i } end
      local text = format.prometheus(samples)
      local series = {}
      for s in text:gmatch("\n(tally_value{[^\n]*}) %d+") do
        assert.is_nil(series[s], s)
        series[s] = true
      end
      local n = 0
      for _ in pairs(series) do n = n + 1 end
      assert.equal(#names, n)
    end)

    it("writes names that are not UTF-8 as hex in counter_hex", function()
      assert.equal(DEFAULT .. 'tally_value{counter_hex="78ff0a"} 1\n',
                   format.prometheus({ { name = "x\255\n", value = 1 } }))
    end)

    it("tells UTF-8 from other bytes as utf8.len does (strict), in C", function()
      -- the default metric's lines are written in C (core._prom_lines)
      local cases = {
        "\0", "\127", "\194\128", "\223\191", "\224\160\128", "\239\191\191",
        "\240\144\128\128", "\244\143\191\191", "\240\159\152\128",
        "\192\128", "\193\191", "\224\128\128", "\224\159\191", "\240\128\128\128",
        "\237\160\128", "\237\191\191", "\237\159\191", "\244\144\128\128",
        "\245\128\128\128", "\248\136\128\128\128", "\128", "\191", "\194", "\224\160",
        "\240\144\128", "\194\0", "\226\130\172x", "x\226\130",
      }
      for _, s in ipairs(cases) do
        local hex = s:gsub(".", function(c) return string.format("%02x", c:byte()) end)
        local want = require("tally.compat").utf8len(s)
                     and 'tally_value{counter="' .. s .. '"} 1\n'
                     or 'tally_value{counter_hex="' .. hex .. '"} 1\n'
        assert.equal(DEFAULT .. want, format.prometheus({ [s] = 1 }), hex)
      end
    end)

    it("writes long names and many of them whole", function()
      local long = string.rep('a"b\\c\n', 1500)          -- 9,000 bytes, 3,000 of them escaped
      local bad = string.rep("\255", 5000)
      local text = format.prometheus({ [long] = 1, [bad] = 2 })
      assert.equal(DEFAULT .. 'tally_value{counter="' .. string.rep('a\\"b\\\\c\\n', 1500)
                   .. '"} 1\ntally_value{counter_hex="' .. string.rep("ff", 5000) .. '"} 2\n', text)
      local samples, want = {}, {}
      for i = 1, 20000 do samples[#samples + 1] = { name = string.format("n%05d", i), value = i } end
      for i = 1, 20000 do want[i] = string.format('tally_value{counter="n%05d"} %d\n', i, i) end
      assert.equal(DEFAULT .. table.concat(want), format.prometheus(samples))
    end)

    it("writes a one-star family's lines as Lua would: escapes, empty parts, other bytes",
       function()
      -- "p:*:n" is the only entry of its metric: its lines are written in C
      local mapping = { { pattern = "p:*:n", metric = "likes", labels = { "post" } } }
      local samples = { ['p:a"b\\c\nd:n'] = 1, ["p::n"] = 2, ["p:\255:n"] = 3, ["p:é:n"] = 4,
                        ["p:n"] = 5, ["q:1:n"] = 6, ["p:7:n"] = 2^60, ["p:8:n"] = 0.5 }
      assert.equal('# TYPE likes gauge\nlikes{post="7"} 1.152921504606847e+18\n'
                   .. 'likes{post="8"} 0.5\nlikes{post=""} 2\nlikes{post="a\\"b\\\\c\\nd"} 1\n'
                   .. 'likes{post="é"} 4\n' .. DEFAULT .. 'tally_value{counter="p:n"} 5\n'
                   .. 'tally_value{counter_hex="703aff3a6e"} 3\ntally_value{counter="q:1:n"} 6\n',
                   format.prometheus(samples, mapping))
      -- a newer entry that claims some of them first, and one sharing the
      -- metric: those go the general way, and two names on one series fail
      mapping[2] = { pattern = "p:?:n", metric = "one", labels = { "c" } }
      local text = format.prometheus({ ["p:1:n"] = 1, ["p:22:n"] = 2 }, mapping)
      assert.matches('one{c="1"} 1\n', text, 1, true)
      assert.matches('likes{post="22"} 2\n', text, 1, true)
      mapping[3] = { pattern = "x*", metric = "likes", labels = { "post" } }
      assert.error_matches(function()
        format.prometheus({ ["p:22:n"] = 2, ["x22"] = 3 }, mapping)
      end, "both map to the series likes{post=\"22\"}", 1, true)
    end)

    it("splits a family of several stars in C exactly as Lua does", function()
      -- a family of two '*' or more, the only one of its metric, has its
      -- names split and written in C; prom._lua_lines_only makes every
      -- line Lua's, to compare: random mappings over random names,
      -- ambiguous, empty, escaped and non-UTF-8 parts among them
      local bits = { "a", "b", ":", "ab", "é", '"', "\\", "\n", "" }
      local r, word = helper.random_words(42, bits)
      local function render(samples, mapping, lenient)
        local ok, text, skipped = pcall(prom._render_prometheus, samples, mapping, nil, lenient)
        local out = { tostring(ok), tostring(text) }
        for _, sk in ipairs(type(skipped) == "table" and skipped or {}) do
          out[#out + 1] = sk.name .. "|" .. sk.reason .. "|" .. sk.msg
        end
        return table.concat(out, "\0")
      end
      local split = 0
      for case = 1, 300 do
        local mapping = {}
        for m = 1, r(3) do
          local stars, pieces, labels = r(3) + (m == 1 and 1 or 0), { word(2) }, {}
          for j = 1, stars do
            pieces[#pieces + 1] = "*" .. word(2)
            labels[j] = "l" .. j
          end
          mapping[m] = { pattern = table.concat(pieces), labels = labels,
                         metric = (r(4) == 1 and m > 1) and "m1" or "m" .. m }
        end
        local samples = {}
        for _ = 1, 40 do
          local name
          if r(3) == 1 then
            name = word(6) .. (r(4) == 1 and "\255" or "")
          else                                      -- made to match an entry
            name = mapping[r(#mapping)].pattern:gsub("%*", function() return word(3) end)
          end
          if name ~= "" then samples[name] = r(3) == 1 and r(1000) / 8 or r(1000) end
        end
        local fast = render(samples, mapping, true)
        local fast_strict = render(samples, mapping, false)
        local compiled = prom.compile_mapping(mapping)
        for _, e in ipairs(compiled.entries) do if e.split then split = split + 1 end end
        prom._lua_lines_only = true
        local ok, slow, slow_strict = pcall(function()
          return render(samples, mapping, true), render(samples, mapping, false)
        end)
        prom._lua_lines_only = nil
        assert(ok, slow)
        assert.equal(slow, fast, "case " .. case)
        assert.equal(slow_strict, fast_strict, "case " .. case)
      end
      assert.is_true(split > 200, "split entries: " .. split)
      -- more pieces than C takes: the general way
      local many = string.rep("*:", 70)
      local labels = {}
      for j = 1, 70 do labels[j] = "l" .. j end
      local name = string.rep("x:", 70)
      local text = format.prometheus({ [name] = 1 }, { { pattern = many, metric = "m", labels = labels } })
      assert.matches('^# TYPE m gauge\nm{l1="x",l2="x",.*,l70="x"} 1\n$', text)
    end)

    it("maps counters to metrics and labels by pattern, newest entry first", function()
      local mapping = {
        { pattern = "post:*", metric = "post_things", labels = { "what" } },
        { pattern = "post:*:likes", metric = "likes_total", labels = { "post" }, type = "counter",
          help = "Likes per post" },
        { pattern = "v?:*:*", metric = "views_total", labels = { "shard", "page", "kind" },
          type = "counter" },
      }
      assert.equal("# HELP likes_total Likes per post\n# TYPE likes_total counter\n"
                   .. 'likes_total{post="1"} 5\nlikes_total{post="a:b"} 6\n'
                   .. '# TYPE post_things gauge\npost_things{what="1:shares"} 7\n'
                   .. DEFAULT .. 'tally_value{counter="other"} 9\n'
                   .. '# TYPE views_total counter\nviews_total{shard="3",page="home",kind="x"} 8\n',
                   format.prometheus({ { name = "post:1:likes", value = 5 },
                                       { name = "post:a:b:likes", value = 6 },
                                       { name = "post:1:shares", value = 7 },
                                       { name = "v3:home:x", value = 8 },
                                       { name = "other", value = 9 } }, mapping))
    end)

    it("raises on a name whose wildcards could split more than one way", function()
      local mapping = { { pattern = "resp:*:*", metric = "resp_total", labels = { "route", "status" },
                          type = "counter" } }
      assert.equal('# TYPE resp_total counter\nresp_total{route="a",status="200"} 1\n',
                   format.prometheus({ { name = "resp:a:200", value = 1 } }, mapping))
      assert.equal("prometheus: counter 'resp:a:b:200' matches 'resp:*:*' in more than one way, "
                   .. "so its label values are ambiguous",
                   err(format.prometheus, { { name = "resp:a:200", value = 1 },
                                            { name = "resp:a:b:200", value = 2 } }, mapping))
      -- one star, or stars kept apart by what cannot appear in their parts: one way
      assert.is_string(format.prometheus({ { name = "resp:a:b:200", value = 2 } },
                                         { { pattern = "resp:*", metric = "r", labels = { "x" } } }))
    end)

    it("sanitises metric and label names from a mapping", function()
      assert.equal("_9lives", prom.metric_name("9lives"))
      assert.equal("a_b:c__", prom.metric_name("a-b:c\255é"):sub(1, 7))
      assert.equal("_", prom.metric_name(""))
      assert.equal("a_b_c", prom.label_name("a:b.c"))
      assert.equal("_1", prom.label_name("1"))
      assert.equal('# TYPE _1_m_x gauge\n_1_m_x{_1_l="v"} 1\n',
                   format.prometheus({ { name = "p:v", value = 1 } },
                                     { { pattern = "p:*", metric = "1.m-x", labels = { "1-l" } } }))
    end)

    it("falls back to the default metric when a captured part is not UTF-8", function()
      assert.equal('# TYPE m gauge\nm{id="é"} 1\n' .. DEFAULT .. 'tally_value{counter_hex="703aff"} 2\n',
                   format.prometheus({ { name = "p:é", value = 1 }, { name = "p:\255", value = 2 } },
                                     { { pattern = "p:*", metric = "m", labels = { "id" } } }))
    end)

    it("writes a counter named twice once, with its last value", function()
      assert.equal(DEFAULT .. 'tally_value{counter="a"} 3\n',
                   format.prometheus({ { name = "a", value = 1 }, { name = "a", value = 3 } }))
    end)

    it("raises when two counters map to one series, or one metric gets two types", function()
      local m = { { pattern = "a:*", metric = "m", labels = { "id" } },
                  { pattern = "b:*", metric = "m", labels = { "id" } } }
      assert.equal([[prometheus: counters 'a:1' and 'b:1' both map to the series m{id="1"}]],
                   err(format.prometheus, { { name = "a:1", value = 1 }, { name = "b:1", value = 2 } }, m))
      -- an empty label value is no label to Prometheus
      local m2 = { { pattern = "a", metric = "m" }, { pattern = "b*", metric = "m", labels = { "id" } } }
      assert.equal([[prometheus: counters 'a' and 'b' both map to the series m{id=""}]],
                   err(format.prometheus, { { name = "a", value = 1 }, { name = "b", value = 2 } }, m2))
      assert.equal("bad argument #2 to 'prometheus' (metric 'm' is a gauge in mapping[1] and a counter in mapping[2])",
                   err(format.prometheus, {}, { { pattern = "a", metric = "m" },
                                                { pattern = "b", metric = "m", type = "counter" } }))
      assert.equal("bad argument #2 to 'prometheus' (metric 'tally_value' is a gauge in the default and a counter in mapping[1])",
                   err(format.prometheus, {}, { { pattern = "a", metric = "tally_value", type = "counter" } }))
      assert.equal("bad argument #2 to 'prometheus' (mapping[1].labels has 0 names but 'a*' has 1 wildcard)",
                   err(format.prometheus, {}, { { pattern = "a*", metric = "m" } }))
      assert.equal("bad argument #2 to 'prometheus' (mapping[1].type must be 'counter', 'gauge', 'untyped' or 'histogram', got 'summary')",
                   err(format.prometheus, {}, { { pattern = "a", metric = "m", type = "summary" } }))
      assert.equal("bad argument #2 to 'prometheus' (mapping[1].histogram must be { buckets =, unit = } with a positive unit)",
                   err(format.prometheus, {}, { { pattern = "a", metric = "m", type = "histogram" } }))
      assert.equal("bad argument #1 to 'prometheus' (samples[1].value must be a number, got '1')",
                   err(format.prometheus, { { name = "a", value = "1" } }))
    end)

    it("accepts a compiled mapping", function()
      local c = prom.compile_mapping({ { pattern = "a:*", metric = "m", labels = { "id" } } })
      assert.equal('# TYPE m gauge\nm{id="1"} 1\n', format.prometheus({ { name = "a:1", value = 1 } }, c))
      assert.equal("bad argument #1 to 'compile_mapping' (mapping[1].metric must be a non-empty string, got nil)",
                   err(prom.compile_mapping, { { pattern = "a" } }))
    end)
  end)
end)
