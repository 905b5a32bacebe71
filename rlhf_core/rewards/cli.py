"""`rlhf serve-rm`: flags and entry point (cheap to import: the CLI builds its parser with it;
torch and the server load only when the command runs).

    rlhf serve-rm --reward.model_name_or_path DIR[,DIR]  (flat: --reward_pretrain)
    rlhf serve-rm --reward.remote_url reward.py          (flat: --remote_rm_url)
"""

from __future__ import annotations

import sys

DEFAULT_PORT = 5000  # OpenRLHF's serve_rm default


def add_serve_rm_arguments(parser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--reward.model_name_or_path", "--reward_pretrain", dest="reward_pretrain", default=None,
                      metavar="DIR", help="Reward model directory (or s3:// URI); several comma-separated are summed")
    what.add_argument("--reward.remote_url", "--remote_rm_url", dest="remote_rm_url", default=None,
                      metavar="FILE.py", help="Python file defining reward_func(queries, prompts, labels, **kwargs)")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"Port (default {DEFAULT_PORT}; 0: a free one)")
    parser.add_argument("--batch_size", type=int, default=32, help="Reward model forward batch size")
    parser.add_argument("--normalize_reward", "--reward.normalize_enable", dest="normalize_reward",
                        action="store_true", help="Normalise with the reward model's stored reward_mean/std")
    parser.add_argument("--token_file", default=None, help="Where a generated token is written when RLHF_RM_TOKEN "
                        "is unset (default <state dir>/rm_token)")


def serve_rm_main(args) -> int:
    """Run `rlhf serve-rm` until interrupted; 2 for a configuration problem, 1 when it cannot listen."""
    from rlhf_core.infra.settings import ConfigError
    from rlhf_core.rewards.factory import build_reward_source
    from rlhf_core.rewards.server import serve_reward

    if args.batch_size < 1:
        print("rlhf: error: --batch_size must be at least 1", file=sys.stderr)
        return 2
    try:
        if args.remote_rm_url and not args.remote_rm_url.endswith(".py"):
            raise ConfigError("--reward.remote_url: serve-rm serves a reward file (FILE.py), not another server")
        source = build_reward_source(
            [p for p in args.reward_pretrain.split(",") if p.strip()] if args.reward_pretrain else None,
            args.remote_rm_url, normalize=args.normalize_reward, batch_size=args.batch_size)
    except ConfigError as e:
        print(f"rlhf: error: {e}", file=sys.stderr)
        return 2
    try:
        server = serve_reward(source, args.host, args.port, token_file=args.token_file)
    except OSError as e:
        print(f"rlhf: error: cannot serve on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"serving {source!r} at {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
