"""Turn checked rows into token-id examples for each kind of stage.

A prompt is formatted once (chat template, `--input_template`, or as is) and tokenized apart
from its completion; the completion gets the EOS token. Concatenating separately tokenized parts
keeps the prompt/response boundary exact, so the loss mask never leaks into the prompt.

Rows longer than `max_len` fail with the source and row number unless `--truncate` is set, in
which case the completion (never the prompt) is cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config import DataConfig
from rlhf_core.data.loading import DataError, check_rows, has_split, load_mixture, load_split, resolve_source


@dataclass
class Sequence:
    """One tokenized text: `input_ids` and a 0/1 `loss_mask` of the same length."""

    input_ids: list[int]
    loss_mask: list[int]

    @property
    def prompt_len(self) -> int:
        """Tokens before the first loss token (the prompt, for prompt/completion sequences)."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.loss_mask)


@dataclass
class SFTExample:
    seq: Sequence

    @property
    def lengths(self) -> tuple[int, ...]:
        """Its sequences' token counts (micro-batches by tokens: `data/token_budget.py`)."""
        return (len(self.seq.input_ids),)


@dataclass
class PairExample:
    chosen: Sequence
    rejected: Sequence
    margin: float = 0.0

    @property
    def lengths(self) -> tuple[int, ...]:
        return len(self.chosen.input_ids), len(self.rejected.input_ids)


@dataclass
class UnpairedExample:
    seq: Sequence
    desirable: bool

    @property
    def lengths(self) -> tuple[int, ...]:
        return (len(self.seq.input_ids),)


@dataclass
class StepExample:
    """A process-reward row: its tokens with the loss mask on each step's placeholder token, and a
    label per placeholder (an index into the reward tokens, or a token id without them; or the
    probability that the step is right, for soft labels)."""

    seq: Sequence
    targets: list[int]
    soft: list[float] | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        return (len(self.seq.input_ids),)


def prompt_token_ids(tokenizer, text: str, templated: bool) -> list[int]:
    """A prompt's token ids. A chat template writes its own special tokens; plain text gets the
    tokenizer's (e.g. BOS), unless it is a prompt written out already: text that starts with the
    BOS text (rows batch inference wrote) is tokenized as it is, so it never gets a second BOS."""
    bos = tokenizer.bos_token
    written = bool(bos) and text.startswith(bos)
    return tokenizer(text, add_special_tokens=not (templated or written))["input_ids"]


class PromptFormatter:
    """Formats prompts and completions as token ids for one tokenizer and data config."""

    def __init__(self, tokenizer, cfg: DataConfig):
        self.tok = tokenizer
        self.cfg = cfg
        if cfg.tokenizer_chat_template:
            tokenizer.chat_template = cfg.tokenizer_chat_template
        if cfg.apply_chat_template and not tokenizer.chat_template:
            raise DataError("--apply_chat_template: the tokenizer has no chat template (give --tokenizer_chat_template)")
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token: completions could never end")
        if cfg.tokenizer_chat_template or cfg.apply_chat_template:  # a broken template fails here, not mid-data
            self._render([{"role": "user", "content": "1+1="}],
                         "--tokenizer_chat_template" if cfg.tokenizer_chat_template else "the tokenizer's chat template")

    def _render(self, messages: list, what: str, generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except TemplateError as e:
            line = f" (template line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise DataError(f"{what}: cannot be rendered{line}: {type(e).__name__}: {e}") from None

    def prompt_text(self, prompt, where: str | None = None, row: int | None = None) -> str:
        at = f"{where}: row {row}: " if where is not None else ""
        if self.cfg.apply_chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return self._render(messages, f"{at}the chat template")
        if isinstance(prompt, list):
            raise DataError(f"{at}chat-format prompts need --apply_chat_template")
        return self.cfg.input_template.format(prompt) if self.cfg.input_template else prompt

    def prompt_ids(self, prompt, where: str | None = None, row: int | None = None) -> list[int]:
        return prompt_token_ids(self.tok, self.prompt_text(prompt, where, row), self.cfg.apply_chat_template)

    def completion_ids(self, completion: str) -> list[int]:
        ids = self.tok(completion, add_special_tokens=False)["input_ids"]
        return ids if ids and ids[-1] == self.tok.eos_token_id else [*ids, self.tok.eos_token_id]

    def join(self, prompt_ids: list[int], completion_ids: list[int], where: str, row: int,
             loss_on_prompt: bool = False) -> Sequence:
        ids = prompt_ids + completion_ids
        mask = [1 if loss_on_prompt else 0] * len(prompt_ids) + [1] * len(completion_ids)
        return self._fit(ids, mask, where, row)

    def conversation(self, messages: list, where: str, row: int) -> Sequence:
        """A whole conversation (`--multiturn`), as the chat template writes it: every assistant turn
        is in the loss, everything before and between them is context. Each piece is tokenized apart
        (the boundaries are exact) and the pieces together are the rendered conversation."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise DataError(f"{where}: row {row}: --multiturn: the conversation has no assistant message to learn")
        ids, mask, done = [], [], ""
        for i in turns:
            before = self._render(messages[:i], f"{where}: row {row}: the chat template")
            upto = self._render(messages[: i + 1], f"{where}: row {row}: the chat template", generation_prompt=False)
            if not (before.startswith(done) and upto.startswith(before)):
                raise DataError(f"{where}: row {row}: --multiturn: the chat template does not write the conversation "
                                f"as a growing text (message {i + 1} changes what came before it)")
            for text, in_loss in ((before[len(done):], 0), (upto[len(before):], 1)):
                piece = self.tok(text, add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [in_loss] * len(piece)
            done = upto
        if ids[-1] != self.tok.eos_token_id:  # the last turn ends the text
            ids, mask = [*ids, self.tok.eos_token_id], [*mask, 1]
        return self._fit(ids, mask, where, row)

    def _fit(self, ids: list[int], mask: list[int], where: str, row: int) -> Sequence:
        """`max_len`: a longer row fails, or with `--truncate` loses its end (not all of its loss tokens)."""
        mask[0] = 0  # nothing predicts the first token
        if len(ids) > self.cfg.max_len:
            if not self.cfg.truncate:
                raise DataError(f"{where}: row {row}: {len(ids)} tokens, longer than --max_len {self.cfg.max_len} "
                                "(raise --max_len or pass --truncate)")
            if 1 not in mask[: self.cfg.max_len]:
                raise DataError(f"{where}: row {row}: the prompt alone has {mask.index(1)} tokens "
                                f"(--max_len {self.cfg.max_len}); truncation only cuts completions")
            ids, mask = ids[: self.cfg.max_len], mask[: self.cfg.max_len]
        return Sequence(ids, mask)


def _rows_with_origin(ds, described):
    """Yield (row, where, row_number) for a (possibly mixed) dataset, best effort for mixtures."""
    where = described[0]["path"] if len(described) == 1 else "+".join(d["path"] for d in described)
    for i, row in enumerate(ds, start=1):
        yield row, where, i


def load_sft(cfg: DataConfig, tokenizer, split: str, seed: int, pretrain_mode: bool = False,
             eval_dataset: str | None = None):
    multiturn = getattr(cfg, "multiturn", False)
    keys = [cfg.input_key] if pretrain_mode or multiturn else [cfg.input_key, cfg.output_key]
    kept = [cfg.input_key, cfg.output_key] if multiturn else keys  # multi-turn: an output column if there is one
    chat = {cfg.input_key} if cfg.apply_chat_template else set()
    ds, described = _load(cfg, split, seed, kept, lambda d, w: check_rows(d, w, keys, chat_keys=chat), eval_dataset)
    if ds is None:
        return None, []
    fmt = PromptFormatter(tokenizer, cfg)
    examples = []
    for row, where, i in _rows_with_origin(ds, described):
        if multiturn:
            examples.append(SFTExample(fmt.conversation(_whole_conversation(row, cfg, where, i), where, i)))
        elif pretrain_mode:
            ids = tokenizer(row[cfg.input_key], add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
            examples.append(SFTExample(fmt.join(ids[:1], ids[1:], where, i, loss_on_prompt=True)))
        else:
            p = fmt.prompt_ids(row[cfg.input_key], where, i)
            examples.append(SFTExample(fmt.join(p, fmt.completion_ids(row[cfg.output_key]), where, i)))
    return examples, described


def single_token_id(tokenizer, token: str, flag: str) -> int:
    """The one id `token` encodes to (ConfigError naming the flag otherwise)."""
    from rlhf_core.infra.settings import ConfigError

    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ConfigError(f"{flag} {token!r}: the tokenizer writes it as {len(ids)} tokens {ids}; it must be one "
                          "(add it to the tokenizer as a special token, or choose a token it has)")
    return ids[0]


def load_steps(cfg, tokenizer, split: str, seed: int, eval_dataset: str | None = None):
    """Process-reward rows (OpenRLHF's `train_prm`): `input_key` text whose steps each end with
    `placeholder_token`, `label_key` a list with a label per placeholder. The text is tokenized as
    it is (no template, no BOS); rows longer than `max_len` fail, or with `--truncate` keep the
    steps whose placeholder fits (and their labels)."""
    placeholder = single_token_id(tokenizer, cfg.placeholder_token, "--placeholder_token")
    reward_ids = [single_token_id(tokenizer, t, "--reward_tokens") for t in cfg.reward_tokens or []]
    ds, described = _load(cfg, split, seed, [cfg.input_key, cfg.label_key],
                          lambda d, w: check_rows(d, w, [cfg.input_key], {cfg.label_key: (list,)}), eval_dataset)
    if ds is None:
        return None, []
    examples, kinds = [], set()
    for row, where, i in _rows_with_origin(ds, described):
        labels = row[cfg.label_key]
        ids = tokenizer(row[cfg.input_key], add_special_tokens=False)["input_ids"]
        steps = [t for t, token in enumerate(ids) if token == placeholder]
        if len(steps) != len(labels):
            raise DataError(f"{where}: row {i}: {len(steps)} placeholder tokens {cfg.placeholder_token!r} in "
                            f"{cfg.input_key!r} but {len(labels)} labels in {cfg.label_key!r}: one label per step")
        if not steps:
            raise DataError(f"{where}: row {i}: no placeholder token {cfg.placeholder_token!r} in {cfg.input_key!r}: "
                            "no step to learn")
        targets, soft = _step_targets(labels, tokenizer, reward_ids, cfg, where, i)
        kinds.add(soft is None)
        if len(kinds) > 1:
            raise DataError(f"{where}: row {i}: {cfg.label_key!r} mixes probabilities and label tokens with the rows "
                            "before it: one kind of label per dataset")
        if len(ids) > cfg.max_len:
            if not cfg.truncate:
                raise DataError(f"{where}: row {i}: {len(ids)} tokens, longer than --max_len {cfg.max_len} (raise "
                                "--max_len or pass --truncate)")
            ids = ids[: cfg.max_len]
            kept = sum(t < cfg.max_len for t in steps)
            if not kept:
                raise DataError(f"{where}: row {i}: no step's placeholder within --max_len {cfg.max_len}")
            steps, targets, soft = steps[:kept], targets[:kept], None if soft is None else soft[:kept]
        mask = [0] * len(ids)
        for t in steps:
            mask[t] = 1
        examples.append(StepExample(Sequence(ids, mask), targets, soft))
    return examples, described


def _step_targets(labels: list, tokenizer, reward_ids: list[int], cfg, where: str, i: int):
    """(targets, soft) of one row's labels: label tokens as indices into the reward tokens (or token
    ids without them), or probabilities (soft labels, which need two reward tokens)."""
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in labels):
        if len(reward_ids) != 2:
            raise DataError(f"{where}: row {i}: {cfg.label_key!r} holds probabilities (soft labels), which need two "
                            "--reward_tokens: the first for a right step, the second for a wrong one")
        if not all(0.0 <= x <= 1.0 for x in labels):
            raise DataError(f"{where}: row {i}: {cfg.label_key!r}: a soft label is a probability in [0, 1]")
        return [0] * len(labels), [float(x) for x in labels]
    if not all(isinstance(x, str) for x in labels):
        raise DataError(f"{where}: row {i}: {cfg.label_key!r} must list label tokens (e.g. '+', '-') or "
                        "probabilities, one per step")
    targets = []
    for label in labels:
        ids = tokenizer.encode(label, add_special_tokens=False)
        if reward_ids:
            if len(ids) != 1 or ids[0] not in reward_ids:
                raise DataError(f"{where}: row {i}: label {label!r} is not one of --reward_tokens "
                                f"{' '.join(cfg.reward_tokens)}")
            targets.append(reward_ids.index(ids[0]))
        else:
            if len(ids) != 1:
                raise DataError(f"{where}: row {i}: label {label!r} is {len(ids)} tokens; a label is one token")
            targets.append(ids[0])
    return targets, None


def _whole_conversation(row: dict, cfg: DataConfig, where: str, i: int) -> list[dict]:
    """`--multiturn`: the input column's messages, then the output column's where a row has one (a
    message, a list of them, or the text of a last assistant turn), as OpenRLHF reads them."""
    messages = row[cfg.input_key]
    if not isinstance(messages, list):
        raise DataError(f"{where}: row {i}: --multiturn: key {cfg.input_key!r} must be a list of {{role, content}} "
                        "messages (the whole conversation)")
    tail = row.get(cfg.output_key)
    if tail is None or tail == "":
        tail = []
    elif isinstance(tail, str):
        tail = [{"role": "assistant", "content": tail}]
    elif isinstance(tail, dict):
        tail = [tail]
    if not isinstance(tail, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in tail):
        raise DataError(f"{where}: row {i}: --multiturn: key {cfg.output_key!r} must be text or {{role, content}} "
                        "messages")
    return [*messages, *tail]


def load_pairs(cfg: DataConfig, tokenizer, split: str, seed: int, eval_dataset: str | None = None):
    keys = [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key]
    other = {cfg.margin_key: (int, float)} if cfg.margin_key else {}
    chat = {cfg.prompt_key} if cfg.apply_chat_template else set()
    ds, described = _load(cfg, split, seed, keys + list(other),
                          lambda d, w: check_rows(d, w, keys, other, chat_keys=chat), eval_dataset)
    if ds is None:
        return None, []
    fmt = PromptFormatter(tokenizer, cfg)
    examples = []
    for row, where, i in _rows_with_origin(ds, described):
        p = fmt.prompt_ids(row[cfg.prompt_key], where, i)
        examples.append(PairExample(
            fmt.join(p, fmt.completion_ids(row[cfg.chosen_key]), where, i),
            fmt.join(p, fmt.completion_ids(row[cfg.rejected_key]), where, i),
            float(row[cfg.margin_key]) if cfg.margin_key else 0.0,
        ))
    return examples, described


def load_unpaired(cfg: DataConfig, tokenizer, split: str, seed: int, eval_dataset: str | None = None):
    """KTO data: (prompt, completion, label) rows; paired preference rows are unpaired.

    A source with `chosen_key`/`rejected_key` columns gives one desirable and one undesirable
    example per row; otherwise `input_key`, `output_key` and a boolean `label_key` are required.
    """
    columns = _first_source_columns(cfg, split, eval_dataset)
    if columns is None:
        return None, []
    if cfg.chosen_key in columns and cfg.rejected_key in columns:
        pairs, described = load_pairs(cfg, tokenizer, split, seed, eval_dataset)
        out = []
        for ex in pairs:
            out.append(UnpairedExample(ex.chosen, True))
            out.append(UnpairedExample(ex.rejected, False))
        return out, described
    keys = [cfg.input_key, cfg.output_key]
    chat = {cfg.input_key} if cfg.apply_chat_template else set()
    ds, described = _load(cfg, split, seed, keys + [cfg.label_key],
                          lambda d, w: check_rows(d, w, keys, {cfg.label_key: (bool,)}, chat_keys=chat), eval_dataset)
    fmt = PromptFormatter(tokenizer, cfg)
    out = []
    for row, where, i in _rows_with_origin(ds, described):
        p = fmt.prompt_ids(row[cfg.input_key], where, i)
        c = fmt.completion_ids(row[cfg.output_key])
        out.append(UnpairedExample(fmt.join(p, c, where, i), bool(row[cfg.label_key])))
    return out, described


def _specs(cfg: DataConfig, split: str, eval_dataset: str | None) -> tuple[str, bool]:
    is_eval = split != cfg.dataset_split
    return (eval_dataset if (is_eval and eval_dataset) else cfg.dataset), is_eval


def _split_of(cfg: DataConfig, split: str, eval_dataset: str | None) -> tuple[str, bool, str]:
    """(split to read, whether it may be absent, its flag). The training split must exist; so must
    the held-out one of an explicit --eval_dataset, where a single file is its own split (as
    `rlhf eval` reads it); the default held-out split of --dataset is used when it is there."""
    if split == cfg.dataset_split:
        return split, False, "--dataset_split"
    if not eval_dataset:
        return split, True, "--eval_split"
    sources = [resolve_source(s) for s in eval_dataset.split(",") if s.strip()]
    if sources and all(s.single_file for s in sources) and not any(has_split(s, split) for s in sources):
        return "train", False, "--eval_split"
    return split, False, "--eval_split"


def _load(cfg: DataConfig, split: str, seed: int, keys: list[str], check, eval_dataset: str | None):
    specs, is_eval = _specs(cfg, split, eval_dataset)
    split, optional, flag = _split_of(cfg, split, eval_dataset)
    return load_mixture(specs, split, None if is_eval else cfg.probs,
                        cfg.max_eval_samples if is_eval else cfg.max_samples, seed, keys, check,
                        optional=optional, split_flag=flag)


def _first_source_columns(cfg: DataConfig, split: str, eval_dataset: str | None) -> list[str] | None:
    """Columns of the first source's split (None when it may be and is absent); decides the KTO format."""
    specs, _ = _specs(cfg, split, eval_dataset)
    split, optional, flag = _split_of(cfg, split, eval_dataset)
    source = resolve_source(specs.split(",")[0])
    if not has_split(source, split):
        if optional:
            return None
        raise DataError(f"{source.spec}: no {split!r} split ({flag} {split}; splits there: "
                        f"{', '.join(sorted(source.data_files))})")
    return load_split(source, split).column_names
