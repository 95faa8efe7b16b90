"""The hostile pass of issue 30: inputs of the eleven defect classes that the tests do not name,
each classified as a clear early error, silent, or a crash.

Every case says what a fair user should get: the good rows written and the bad ones in ERRORS
with their lines ("rows"), the command refused with a message naming the value ("refused"),
an API call raising ValueError/TypeError naming the value ("raises"), a request failing alone
with its error ("fails"), or the call working ("works"). A case is
  clear   when it got that (an early error naming the value, or the right result),
  silent  when it returned without error but lost, kept or mis-served something,
  crash   when anything else happened (a traceback, another exception type, a timeout).

    PYTHONPATH=. python scripts/hostile_pass.py [--json PATH] [--no-replicas]

Runs on the `tiny` preset (a batch job on one engine in this process; the router cases start
two replica processes). Prints one line per case and the table.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.hostile_cases import Ctx  # noqa: E402
from scripts.hostile_list import ALL_CASES  # noqa: E402


def run_case(ctx: Ctx, case) -> tuple:
    """(outcome, detail) of one case."""
    try:
        return case.fn(ctx)
    except Exception as e:  # noqa: BLE001 - anything unexpected is a crash
        return "crash", f"{type(e).__name__}: {str(e)[:200]}\n{traceback.format_exc()[-600:]}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write every case and outcome here")
    ap.add_argument("--no-replicas", action="store_true", help="skip the router cases (they "
                    "start two replica processes)")
    args = ap.parse_args(argv)
    # an absurd size that slipped past the checks fails here instead of swapping the host
    resource.setrlimit(resource.RLIMIT_AS, (24 * 2**30, resource.RLIM_INFINITY))
    cases = [c for c in ALL_CASES if not (args.no_replicas and c.cls == "10 router")]
    results = []
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        ctx = Ctx(tmp)
        for i, case in enumerate(cases):
            outcome, detail = run_case(ctx, case)
            results.append(dict(cls=case.cls, name=case.name, outcome=outcome, detail=detail))
            print(f"[{i + 1:3d}] {outcome:6s} {case.cls:14s} {case.name}"
                  + (f"\n        {detail}" if outcome != "clear" else ""), flush=True)
        ctx.close()
    table = collections.defaultdict(collections.Counter)
    for r in results:
        table[r["cls"]][r["outcome"]] += 1
    print(f"\n| class | cases | clear | silent | crash |\n|---|---|---|---|---|")
    for cls in sorted(table):
        c = table[cls]
        print(f"| {cls} | {sum(c.values())} | {c['clear']} | {c['silent']} | {c['crash']} |")
    total = collections.Counter(r["outcome"] for r in results)
    print(f"| all | {len(results)} | {total['clear']} ({total['clear'] / len(results):.1%}) | "
          f"{total['silent']} | {total['crash']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return dict(results=results, total=dict(total))


if __name__ == "__main__":
    main()
