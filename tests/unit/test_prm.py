"""Process reward models: the column-addition task's steps and labels, OpenRLHF's PRM loss by hand,
`rlhf train prm`'s rows and their errors. (That a PRM learns held-out step labels:
tests/learning/test_prm_learning.py; a killed run resumes bit-identical: test_resume.py.)"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from rlhf_core.algos.losses import process_reward_losses
from rlhf_core.cli import main
from rlhf_core.data import steps
from rlhf_core.data.synthetic import get_task


def test_a_solution_is_a_line_per_column_then_the_sum():
    assert steps.write_solution(steps.columns_of(482, 397)) == "2+7+0=9\n8+9+0=17\n4+3+1=8\n=879"
    assert steps.write_solution(steps.columns_of(95, 7)) == "5+7+0=12\n9+0+1=10\n=102"  # the last carry leads
    assert steps.write_solution(steps.columns_of(0, 0)) == "0+0+0=0\n=0"
    task, rng = get_task("addition_steps"), random.Random(0)
    for _ in range(2000):
        prompt, answer = task.generate(rng)
        a, b = map(int, prompt.removeprefix("add ").removesuffix("=").split("+"))
        assert answer.split("\n")[-1] == f"={a + b}" and len(answer) <= task.max_answer_len
        assert steps.step_labels(prompt, answer) == ["+"] * len(answer.split("\n"))


def test_a_wrong_carry_is_followed_through_and_labels_every_step_from_it_wrong():
    prompt, right = "add 482+397=", "2+7+0=9\n8+9+0=17\n4+3+1=8\n=879"
    assert steps.write_solution(steps.columns_of(482, 397), flipped_at=2) == "2+7+0=9\n8+9+0=17\n4+3+0=7\n=779"
    assert steps.step_labels(prompt, "2+7+0=9\n8+9+0=17\n4+3+0=7\n=779") == ["+", "+", "-", "-"]
    # From a wrong step on every step is wrong, even one the true solution also writes.
    assert steps.step_labels(prompt, "2+7+1=10\n8+9+1=18\n4+3+1=8\n=889") == ["-", "-", "-", "-"]
    assert steps.step_labels(prompt, right + "\n=879") == ["+"] * 4 + ["-"]  # an extra step
    assert steps.step_labels(prompt, "2+7+0=9") == ["+"]  # a solution cut short: its steps so far
    rng = random.Random(1)
    for _ in range(200):
        wrong = get_task("addition_steps").near_miss(right, rng)
        assert wrong.split("\n")[-1] != "=879" and "-" in steps.step_labels(prompt, wrong)
    assert steps.prm_text(prompt, right) == "add 482+397=\n2+7+0=9 ки\n8+9+0=17 ки\n4+3+1=8 ки\n=879 ки"
    with pytest.raises(ValueError, match="not a prompt of the column-addition task"):
        steps.step_labels("sort: CBA", right)


def test_the_prm_loss_by_hand():
    logits = torch.tensor([[0.0, 2.0, -1.0, 0.5], [1.0, 0.0, 3.0, 0.0]])
    # Over the reward tokens (ids 2 and 1: '+' then '-'): row 0 labelled '+' (index 0), row 1 '-' (index 1).
    loss, right = process_reward_losses(logits, torch.tensor([0, 1]), reward_ids=[2, 1])
    ce0 = -math.log(math.exp(-1.0) / (math.exp(-1.0) + math.exp(2.0)))
    ce1 = -math.log(math.exp(0.0) / (math.exp(3.0) + math.exp(0.0)))
    assert loss.item() == pytest.approx(ce0 + ce1) and right.item() == 0.0  # both argmaxes are the other token
    # Without reward tokens: the whole vocabulary, the label a token id.
    loss, right = process_reward_losses(logits, torch.tensor([1, 2]))
    assert loss.item() == pytest.approx(-(torch.log_softmax(logits, -1)[0, 1] + torch.log_softmax(logits, -1)[1, 2]))
    assert right.item() == 2.0
    # Soft labels: cross-entropy to [p, 1 - p], which is BCE with logits on z+ - z-.
    p = torch.tensor([0.9, 0.2])
    loss, right = process_reward_losses(logits, torch.zeros(2, dtype=torch.long), reward_ids=[2, 1], soft=p)
    margin = logits[:, 2] - logits[:, 1]
    assert loss.item() == pytest.approx(torch.nn.functional.binary_cross_entropy_with_logits(
        margin, p, reduction="sum").item(), rel=1e-6)
    assert right.item() == 0.0  # row 0 says right where '-' wins, row 1 wrong where '+' wins
    with pytest.raises(ValueError, match="two reward tokens"):
        process_reward_losses(logits, torch.zeros(2, dtype=torch.long), reward_ids=[0, 1, 2], soft=p)


@pytest.fixture(scope="module")
def steps_prep(tmp_path_factory):
    from rlhf_core.stages.prep import prepare

    return prepare(tmp_path_factory.mktemp("steps"), task="addition_steps", n_train=256, n_test=32)


def test_prep_writes_step_rows_with_the_placeholder_as_one_token(steps_prep):
    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in open(steps_prep["prm_train"])]
    assert len(rows) == 256 and 0.3 < sum("-" in r["label"] for r in rows) / len(rows) < 0.7  # about half err
    tok = AutoTokenizer.from_pretrained(steps_prep["base"])
    (placeholder,) = tok.encode(steps.PLACEHOLDER, add_special_tokens=False)
    for row in rows[:50]:
        ids = tok(row["input"], add_special_tokens=False)["input_ids"]
        assert ids.count(placeholder) == len(row["label"]) == len(steps.split_steps(row["response"]))
        assert row["label"] == steps.step_labels(row["prompt"], row["response"])


def test_bad_step_rows_exit_2_naming_the_row(steps_prep, tmp_path, capsys):
    def run(rows, *extra, dry_run=False):
        """Rows are read and checked before any rank starts (a dry run reads the config alone)."""
        data = tmp_path / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        code = main(["train", "prm", "--pretrain", steps_prep["base"], "--dataset", str(data), "--placeholder_token",
                     steps.PLACEHOLDER, "--reward_tokens", "+", "-", "--train_batch_size", "1",
                     "--micro_train_batch_size", "1", "--save_path", str(tmp_path / "out"), "--use_mlflow", "false",
                     *(["--dry_run"] if dry_run else []), *extra])
        return code, capsys.readouterr()

    good = {"input": "add 1+2=\n1+2+0=3 ки\n=3 ки", "label": ["+", "+"]}
    code, out = run([good, good], dry_run=True)
    assert code == 0, out.err
    cases = [
        ({"input": good["input"], "label": ["+"]}, "row 2: 2 placeholder tokens 'ки' in 'input' but 1 labels"),
        ({"input": good["input"], "label": ["+", "x"]}, "row 2: label 'x' is not one of --reward_tokens + -"),
        ({"input": "add 1+2=3", "label": []}, "row 2: no placeholder token"),
        ({"input": good["input"], "label": "++"}, "row 2: key 'label' must be list"),
        ({"input": good["input"], "label": [0.5, 1.0]}, "row 2: 'label' mixes probabilities and label tokens"),
        ({"input": good["input"], "label": [0.5, 1.5]}, "a soft label is a probability in [0, 1]"),
    ]
    for row, says in cases:
        code, out = run([good, row])
        assert code == 2 and says in out.err, (row, out.err[-600:])
    code, out = run([good], "--max_len", "8")
    assert code == 2 and "longer than --max_len 8" in out.err
    code, out = run([good, good], "--placeholder_token", "add 1", dry_run=False)
    assert code == 2 and "--placeholder_token 'add 1'" in out.err and "tokens" in out.err


def test_truncation_keeps_the_steps_that_fit(steps_prep, tmp_path):
    from rlhf_core.config import PRMDataConfig
    from rlhf_core.data.examples import load_steps
    from rlhf_core.models.loading import load_tokenizer

    tok = load_tokenizer(steps_prep["base"])
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"input": "add 10+2=\n0+2+0=2 ки\n1+0+0=1 ки\n=12 ки", "label": ["+", "-", "-"]}))
    ids = tok("add 10+2=\n0+2+0=2 ки\n1+0+0=1 ки", add_special_tokens=False)["input_ids"]
    cfg = PRMDataConfig(dataset=str(data), placeholder_token=steps.PLACEHOLDER, reward_tokens=["+", "-"],
                        max_len=len(ids), truncate=True)
    (example,), _ = load_steps(cfg, tok, "train", 0)
    assert example.targets == [0, 1] and sum(example.seq.loss_mask) == 2 and len(example.seq.input_ids) == len(ids)
    soft = tmp_path / "soft.jsonl"
    soft.write_text(json.dumps({"input": "add 1+2=\n1+2+0=3 ки\n=3 ки", "label": [0.75, 0.25]}))
    (example,), _ = load_steps(cfg.model_copy(update={"dataset": str(soft)}), tok, "train", 0)
    assert example.soft == [0.75, 0.25]


def test_the_scorer_reads_each_placeholder_as_a_whole_forward_does(steps_prep):
    """`ProcessRewardModel` (the LM head at the placeholders only, as the trainer reads them) gives
    each step the softmax over the reward tokens of a plain transformers forward at that placeholder;
    padding, batching and a response with no step change nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.algos.names import STEP_AGGREGATES
    from rlhf_core.rewards.process import AGGREGATE, ProcessRewardModel, aggregate

    prm = ProcessRewardModel.load(steps_prep["base"], steps.PLACEHOLDER, ["+", "-"], batch_size=2,
                                  device=torch.device("cpu"), dtype=torch.float32)
    prompts = ["add 482+397=", "add 5+7=", "add 1+1=", "add 95+7="]
    responses = ["2+7+0=9\n8+9+0=17\n4+3+1=8\n=879", "5+7+0=12\n=12", "", "5+7+0=12\n9+0+1=10\n=102"]
    got = prm.step_scores(prompts, responses)
    tok, model = AutoTokenizer.from_pretrained(steps_prep["base"]), AutoModelForCausalLM.from_pretrained(steps_prep["base"])
    reward_ids = [tok.encode(t, add_special_tokens=False)[0] for t in ("+", "-")]
    for prompt, response, scores in zip(prompts, responses, got, strict=True):
        ids = tok(steps.prm_text(prompt, response), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        where = [i for i, t in enumerate(ids) if t == prm.placeholder]
        expected = torch.softmax(logits[where][:, reward_ids], -1)[:, 0].tolist()
        assert scores == pytest.approx(expected, abs=1e-5) and len(scores) == len(steps.split_steps(response))
    assert got[2] == [] and aggregate(got[2]) == 0.0
    assert set(AGGREGATE) == set(STEP_AGGREGATES)
    assert [aggregate([0.5, 0.2, 0.9], how) for how in ("min", "prod", "last", "mean")] == \
        pytest.approx([0.2, 0.09, 0.9, 1.6 / 3])


def test_the_scorer_batches_by_a_token_budget_as_the_rl_roles_do(steps_prep):
    """`max_tokens`: each forward a padded batch (rows x the longest) within the budget, a longer
    text alone; the scores are those of batches by count."""
    from rlhf_core.rewards.process import ProcessRewardModel

    by_rows = ProcessRewardModel.load(steps_prep["base"], steps.PLACEHOLDER, ["+", "-"], batch_size=8,
                                      device=torch.device("cpu"), dtype=torch.float32)
    prompts = ["add 482+397=", "add 5+7=", "add 1+1=", "add 95+7=", "add 12345+67890="]
    responses = ["2+7+0=9\n8+9+0=17\n4+3+1=8\n=879", "5+7+0=12\n=12", "1+1+0=2\n=2", "5+7+0=12\n9+0+1=10\n=102",
                 "5+0+0=5\n4+9+0=13\n3+8+1=12\n2+7+1=10\n1+6+1=8\n=80235"]
    seqs = [by_rows.tokenizer(t, add_special_tokens=False)["input_ids"] for t in by_rows.texts(prompts, responses)]
    budget = 2 * max(map(len, seqs[:2]))
    by_tokens = ProcessRewardModel(by_rows.tokenizer, by_rows.model, steps.PLACEHOLDER, ["+", "-"], batch_size=8,
                                   max_tokens=budget)
    chunks = by_tokens.chunks(seqs)
    assert [s for c in chunks for s in c] == seqs and len(chunks) > 1
    assert all(len(c) * max(map(len, c)) <= budget or len(c) == 1 for c in chunks)
    assert by_rows.chunks(seqs) == [seqs]
    for got, want in zip(by_tokens.step_scores(prompts, responses), by_rows.step_scores(prompts, responses), strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_each_step_ends_at_the_token_that_completes_it(steps_prep):
    """Step rewards in RL sit where a step is written out: the token that writes its closing newline,
    and the response's last token (EOS included) for the last step; blank lines are no steps."""
    from transformers import AutoTokenizer

    from rlhf_core.rewards.process import step_end_tokens

    tok = AutoTokenizer.from_pretrained(steps_prep["base"])

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    for response in ["5+6+0=11\n0+7+1=8\n=81", "5+6+0=11\n\n0+7+1=8\n=81\n", "=12", ""]:
        ids = tok.encode(response, add_special_tokens=False) + ([tok.eos_token_id] if response else [])
        ends = step_end_tokens(decode, ids)
        assert len(ends) == len(steps.split_steps(response))
        if not ends:
            continue
        assert ends[-1] == len(ids) - 1 and ends == sorted(set(ends))
        def complete(text):  # the steps whose closing newline is written
            return len(steps.split_steps(text.rpartition("\n")[0]))

        for j, end in enumerate(ends[:-1]):  # step j is complete at its token, not a token earlier
            assert complete(decode(ids[:end])) == j and complete(decode(ids[: end + 1])) == j + 1
