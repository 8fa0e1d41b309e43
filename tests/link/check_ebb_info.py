"""check_ebb_info.py: `ebb-info --json` is one valid JSON object that tells the truth.

Checks the shape (driver, devices, config, allocator), that the emulated driver shows
EBB_SIM_DEVICES devices, and that the allocator ebb-info detects at run time is the one the build
linked: jemalloc for ebb's programs, unless the build has no jemalloc (sanitizers, option off),
with the settings ebb's malloc_conf asks for in effect.
usage: python3 check_ebb_info.py /path/to/ebb-info <expected allocator name>
"""
import json
import os
import subprocess
import sys


def main(prog: str, want_alloc: str) -> int:
    out = subprocess.run([prog, "--json"], check=True, capture_output=True, text=True).stdout
    info = json.loads(out)  # raises on invalid JSON: the test fails with the parser's message
    for key in ("driver", "devices", "config", "allocator"):
        assert key in info, f"missing '{key}' in {sorted(info)}"
    drv = info["driver"]
    assert drv["device_count"] == len(info["devices"]), drv
    if drv["kind"] == "emulated":
        want = int(os.environ.get("EBB_SIM_DEVICES", "2"))
        assert len(info["devices"]) == want, f"{len(info['devices'])} devices, expected {want}"
        for d in info["devices"]:
            assert d["emulated"] is True and d["compute_capability"] == "emulated", d
    for d in info["devices"]:
        assert d["total_mem"] > 0 and isinstance(d["capabilities"], list), d
    assert info["config"]["EBB_DRIVER"]["value"], info["config"]["EBB_DRIVER"]
    got = info["allocator"]["name"]
    assert got == want_alloc, f"allocator {got} ({info['allocator']['provider']}), expected {want_alloc}"
    if got == "jemalloc" and "MALLOC_CONF" not in os.environ:
        # The settings ebb's programs give jemalloc (common/ebb_malloc_conf.c) are the ones in
        # effect: a malloc_conf the linker left hidden is silently ignored.
        want_opts = {"dirty_decay_ms": -1, "muzzy_decay_ms": -1, "retain": True, "background_thread": False}
        have = info["allocator"].get("settings")
        assert have == want_opts, f"jemalloc runs with {have}, expected ebb's malloc_conf {want_opts}"
    print(f"ok: {drv['name']} with {len(info['devices'])} devices, allocator {got}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: check_ebb_info.py /path/to/ebb-info <allocator>")
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
