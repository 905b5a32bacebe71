"""The flag compatibility table (docs/openrlhf-flags.md), generated from the stage configs.

One table per stage command: each field's flags (its dotted path first, then OpenRLHF's flat and
other spellings), its default, what it does here (the field's description), and a status:
`GPU-only` (the `gpu` marker: what needs what, and what runs elsewhere), `accepted, not read` (the
`noop` marker: why nothing needs it) or nothing (honoured); then the OpenRLHF flags recognised and
refused because their feature is not built yet. `python -m rlhf_core.flag_table > docs/openrlhf-flags.md`
writes it; a test checks the committed file is current.
"""

from __future__ import annotations

import json

from rlhf_core.config import STAGE_CONFIGS, spellings_of

HEADER = """# Flags: what each does here (generated)

Every `rlhf train <stage>` flag (and `rlhf batch_inference`'s), generated from the stage configs by `python -m rlhf_core.flag_table`
(do not edit by hand). A flag's first spelling is its dotted path (OpenRLHF 0.11's, and the YAML
key); the others are OpenRLHF's flat names (0.9 and earlier) and older ones; any spelling works,
in any mix, on the command line and in `--config` YAML. Status: empty means honoured as
OpenRLHF honours it; **GPU-only** means the feature needs a GPU (what runs elsewhere, said in one
`not applied here:` log line); **accepted, not read** means nothing needs it here (why); the last
list of each stage names OpenRLHF flags whose feature is not built yet: they are refused with
exit 2 and that reason. `rlhf train <stage> --dry_run` prints the resolved config of a command.
"""


def _default(field) -> str:
    if field.default_factory is not None:
        return ""
    value = field.default
    value = getattr(value, "value", value)
    if value is None:
        return ""
    text = json.dumps(value) if not isinstance(value, str) else value
    return f"`{text}`"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def stage_table(stage: str, config_cls, command: str | None = None) -> str:
    spellings = spellings_of(config_cls)
    rows = [f"## `{command or f'rlhf train {stage}'}`", "", "| flags | default | what it does here | status |",
            "|---|---|---|---|"]
    for path, field in spellings.leaves.items():
        if path in spellings.skip:
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        names = ", ".join(f"`{n}`" for n in spellings.spellings(path))
        status = (f"**GPU-only**: {extra['gpu']}" if "gpu" in extra
                  else f"accepted, not read: {extra['noop']}" if "noop" in extra else "")
        rows.append(f"| {names} | {_cell(_default(field))} | {_cell(field.description)} | {_cell(status)} |")
    if spellings.deferred:
        rows += ["", "Not built yet (refused, exit 2):", ""]
        by_reason: dict[str, list[str]] = {}
        for name, reason in spellings.deferred.items():
            by_reason.setdefault(reason, []).append(f"`--{name}`")
        rows += [f"- {', '.join(names)}: {reason}" for reason, names in by_reason.items()]
    return "\n".join(rows) + "\n"


def markdown() -> str:
    from rlhf_core.config import BatchInferenceConfig
    from rlhf_core.rl_config import PPOConfig

    stages = {**STAGE_CONFIGS, "ppo": PPOConfig}
    return HEADER + "\n" + "\n".join([*(stage_table(name, cls) for name, cls in stages.items()),
                                       stage_table("batch_inference", BatchInferenceConfig, "rlhf batch_inference")])


if __name__ == "__main__":
    print(markdown(), end="")
