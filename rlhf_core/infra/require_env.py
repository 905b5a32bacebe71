"""`python -m rlhf_core.infra.require_env [--env NAME]... SECRET...`: stop a launch script early
when a credential or setting it needs is not in the environment.

The SkyPilot tasks (deployments/skypilot/) run it before anything starts (on Kubernetes a pod
whose Secret is missing does not start at all), so a forgotten `--secret` fails in a second with the variable's name rather
than an hour later inside a stage. Exit 2 (bad input, as every `rlhf` command) with one line per
missing variable saying how to pass it; 0 when all are there. An empty value counts as missing.
Values are never printed: only names leave this module.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Mapping

from rlhf_core.infra.settings import EXIT_CONFIG


def missing(names: Iterable[str], environ: Mapping[str, str]) -> list[str]:
    """The names in `names` that are unset or empty in `environ`, in order, each once."""
    return [name for name in dict.fromkeys(names) if not environ.get(name)]


def problems(secrets: Iterable[str], settings: Iterable[str], environ: Mapping[str, str]) -> list[str]:
    """One message per missing variable: secrets come from the launcher's secret store, settings are
    plain environment (SkyPilot `--env`, a Kubernetes ConfigMap)."""
    lines = [f"secret {name} is not set: pass it with `sky launch|sky jobs launch ... --secret {name}` (SkyPilot "
             f"reads the value from your shell's {name}), or on Kubernetes from a Secret through envFrom or "
             "secretKeyRef; never write the value into a launch file" for name in missing(secrets, environ)]
    lines += [f"{name} is not set: pass it with `sky launch|sky jobs launch ... --env {name}=...`, or on Kubernetes "
              "in the pod's env (a ConfigMap through envFrom)" for name in missing(settings, environ)]
    return lines


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.infra.require_env",
                                     description="Exit 2 naming every variable below that is unset or empty.")
    parser.add_argument("secrets", nargs="*", metavar="SECRET", help="credentials (passed as launcher secrets)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME", help="settings (plain environment)")
    args = parser.parse_args(argv)
    lines = problems(args.secrets, args.env, os.environ if environ is None else environ)
    for line in lines:
        print(f"rlhf: error: {line}", file=sys.stderr)
    return EXIT_CONFIG if lines else 0


if __name__ == "__main__":
    sys.exit(main())
