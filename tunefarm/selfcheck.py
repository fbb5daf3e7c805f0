"""`python -m tunefarm.selfcheck`: fail fast on a known-broken TVM installation.

apache-tvm-ffi 0.1.15.post2 (what pip picks for apache-tvm 0.27 by default) segfaults in
save_json, pickling and feature extraction; 0.1.14.post1 works.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

KNOWN_GOOD_FFI = ("0.1.14.post1", "0.1.14.post0")


def check() -> list[str]:
    problems = []
    try:
        ffi = version("apache-tvm-ffi")
    except PackageNotFoundError:
        return ["apache-tvm-ffi is not installed"]
    if ffi not in KNOWN_GOOD_FFI:
        problems.append(f"apache-tvm-ffi {ffi} is installed; tunefarm needs {KNOWN_GOOD_FFI[0]} (newer ones segfault)")
    import tvm
    from tvm import te

    a = te.placeholder((4,), name="a")
    b = te.compute((4,), lambda i: a[i] + 1.0, name="b")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b])})
    text = tvm.ir.save_json(mod)  # the call that segfaults with a bad ffi
    if not tvm.ir.load_json(text).same_as(mod) and "main" not in str(tvm.ir.load_json(text).get_global_vars()):
        problems.append("tvm.ir.save_json/load_json round trip failed")
    return problems


def main() -> int:
    problems = check()
    for p in problems:
        print(f"selfcheck: {p}", file=sys.stderr)
    if not problems:
        print("selfcheck: TVM installation OK")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
