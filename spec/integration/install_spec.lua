-- Installing: `cmake --install` into a fresh prefix, then every installed
-- part used from outside the build tree (C through pkg-config and through
-- the CMake package, Lua 5.4, LuaJIT, the tally command and its man page);
-- and `luarocks make` with the rockspec into a fresh tree. Build tools run
-- without LD_PRELOAD; what was built runs with it (in a sanitizer build the
-- installed libraries are instrumented and need the runtime preloaded).
local helper = require "spec.support.helper"

local q = helper.q

local function sh_ok(cmd)
  local out, code = helper.sh(cmd)
  if code ~= 0 then error(("exit %s: %s\n%s"):format(tostring(code), cmd, out), 2) end
  return out
end

local C_PROGRAM = [[
#include <stdio.h>
#include <tally.h>
#include <tally_net.h>
int main(void) {
  tally_store *s;
  tally_counter *c;
  int64_t v;
  if (tally_store_open("memory", NULL, &s)) return 1;
  if (tally_counter_open(s, "x", 1, NULL, TALLY_COUNTER_CREATE, &c)) return 2;
  tally_counter_incr(c, 5);
  if (tally_counter_value(c, &v)) return 3;
  printf("%lld %s\n", (long long)v, tally_err_name(TALLY_ECONNECT));
  tally_counter_close(c);
  tally_store_close(s);
  return 0;
}
]]

describe("the installed tree", function()
  local prefix, outside

  setup(function()
    prefix = helper.tmpfile("prefix")
    outside = helper.tmpfile("outside")
    os.execute("mkdir -p " .. q(outside))
    sh_ok("env -u LD_PRELOAD cmake --install " .. q(helper.build) .. " --prefix " .. q(prefix))
    helper.write(outside .. "/use.c", C_PROGRAM)
  end)

  it("has the libraries, headers, pkg-config files, CMake package and man page", function()
    for _, f in ipairs({ "lib/libtally.so", "lib/libtally.a", "lib/libtally_net.so", "lib/libtally_net.a",
                         "include/tally.h", "include/tally_net.h", "lib/pkgconfig/tally.pc",
                         "lib/pkgconfig/tally_net.pc", "lib/cmake/tally/tallyConfig.cmake",
                         "bin/tally", "share/man/man1/tally.1", "lib/lua/5.4/tally/core.so",
                         "share/lua/5.4/tally/init.lua" }) do
      assert.is_true(os.rename(prefix .. "/" .. f, prefix .. "/" .. f), f .. " is not installed")
    end
    local man = sh_ok("env -u LD_PRELOAD MANWIDTH=100 man -l " .. q(prefix .. "/share/man/man1/tally.1") .. " 2>/dev/null | col -b")
    assert.truthy(man:find("tally ls STORE [pattern] [--json]", 1, true), man)
  end)

  it("builds a C program with pkg-config, from outside the build tree", function()
    local env = "env -u LD_PRELOAD PKG_CONFIG_PATH=" .. q(prefix .. "/lib/pkgconfig") .. " "
    local flags = sh_ok(env .. "pkg-config --cflags --libs tally_net"):gsub("\n", "")
    assert.truthy(flags:find(prefix .. "/lib/pkgconfig/../../include", 1, true), flags)
    sh_ok(("cd %s && %s cc use.c %s -Wl,-rpath,%s -o use"):format(q(outside), env, flags,
                                                                  q(prefix .. "/lib")))
    assert.equal("5 ECONNECT\n", sh_ok(q(outside .. "/use")))
  end)

  it("keeps hiredis out of tally_net's interface: no hiredis type, no client call exported", function()
    local header = assert(helper.slurp(prefix .. "/include/tally_net.h"))
    assert.is_nil(header:find("#include <hiredis", 1, true))
    assert.is_nil(header:find("redisReply", 1, true))
    local exported = sh_ok("nm -D --defined-only " .. q(prefix .. "/lib/libtally_net.so"))
    for _, f in ipairs({ "tally_rc_open", "tally_rc_open_opts", "tally_rc_close", "tally_flusher_new",
                         "tally_sender_open" }) do
      assert.truthy(exported:find(" T " .. f .. "\n", 1, true), f .. " is not exported")
    end
    for _, f in ipairs({ "tally_rc_command", "tally_rc_command_wait", "tally_rc_pipe_new",
                         "tally_rc_pipe_reply", "tally_rc_keyslot", "tally_rc_refresh" }) do
      assert.is_nil(exported:find(" " .. f .. "\n", 1, true), f .. " is exported")
    end
  end)

  it("builds a C program with find_package(tally)", function()
    helper.write(outside .. "/CMakeLists.txt", [[
cmake_minimum_required(VERSION 3.18)
project(use C)
find_package(tally 0.1 REQUIRED)
add_executable(use_cmake use.c)
target_link_libraries(use_cmake PRIVATE tally::tally_net)
]])
    sh_ok(("cd %s && env -u LD_PRELOAD cmake -S . -B b -DCMAKE_PREFIX_PATH=%s >/dev/null && "
           .. "env -u LD_PRELOAD cmake --build b >/dev/null"):format(q(outside), q(prefix)))
    assert.equal("5 ECONNECT\n", sh_ok(q(outside .. "/b/use_cmake")))
  end)

  local LUA_USE = [[local t = require "tally"; local db = t.open(); db:incr("a", 2);
    io.write(db:value("a"), " ", package.searchpath("tally.core", package.cpath), "\n")]]

  it("gives Lua 5.4 the module", function()
    local out = sh_ok(("cd %s && env LUA_PATH=%s LUA_CPATH=%s lua5.4 -e %s"):format(
      q(outside), q(prefix .. "/share/lua/5.4/?.lua;" .. prefix .. "/share/lua/5.4/?/init.lua;;"),
      q(prefix .. "/lib/lua/5.4/?.so;;"), q(LUA_USE)))
    assert.equal("2 " .. prefix .. "/lib/lua/5.4/tally/core.so\n", out)
  end)

  it("gives LuaJIT its own build, with the FFI path", function()
    if not os.rename(prefix .. "/lib/lua/5.1/tally/core.so", prefix .. "/lib/lua/5.1/tally/core.so") then
      pending("no LuaJIT build (pkg-config finds no luajit)")
      return
    end
    local out = sh_ok(("cd %s && env LUA_PATH=%s LUA_CPATH=%s luajit -e %s"):format(
      q(outside), q(prefix .. "/share/lua/5.1/?.lua;" .. prefix .. "/share/lua/5.1/?/init.lua;;"),
      q(prefix .. "/lib/lua/5.1/?.so;;"), q(LUA_USE .. " assert(t.ffi)")))
    assert.equal("2 " .. prefix .. "/lib/lua/5.1/tally/core.so\n", out)
  end)

  it("runs the installed tally command with its installed Lua side", function()
    local out = sh_ok(("cd %s && %s -e %s"):format(q(outside),
      q(prefix .. "/bin/tally"), q([[print(package.searchpath("tally", package.path))]])))
    assert.equal(prefix .. "/bin/../share/lua/5.4/tally/init.lua\n", out)
  end)
end)

describe("the rockspec", function()
  it("builds and installs the module with luarocks make, for Lua 5.4", function()
    local rockspec = helper.sh("ls tally-*.rockspec"):match("[^\n]+")
    assert.truthy(rockspec, "no rockspec at the root")
    local tree = helper.tmpfile("rocks")
    sh_ok(("env -u LD_PRELOAD luarocks --lua-version 5.4 --tree %s make --deps-mode=none %s"):format(
      q(tree), q(rockspec)))
    local out = sh_ok(("cd / && env LUA_PATH=%s LUA_CPATH=%s lua5.4 -e %s"):format(
      q(tree .. "/share/lua/5.4/?.lua;" .. tree .. "/share/lua/5.4/?/init.lua;;"),
      q(tree .. "/lib/lua/5.4/?.so;;"), q([[local t = require "tally"; local db = t.open();
        db:incr("a", 3); io.write(db:value("a"), " ", package.searchpath("tally.core", package.cpath), "\n")]])))
    assert.equal("3 " .. tree .. "/lib/lua/5.4/tally/core.so\n", out)
  end)
end)
