"""The weight sync's broadcast path without Ray: an actor process and two engine processes join a
gloo group of their own (`SyncGroup`, the code NCCL runs on GPUs), the actor takes a training step
and broadcasts; both engines end with weights equal (`torch.equal`) to the actor's, tied weights
included. A receiver that never joins the broadcast fails the others within the deadline. Plus the
pure parts: which transport a config gets, buckets, packing."""

import multiprocessing
import time

import pytest
import torch

from rlhf_core.infra.network import rendezvous_port
from rlhf_core.infra.settings import ConfigError
from rlhf_core.rollout.weight_sync import (
    SyncBackend,
    TensorMeta,
    pack,
    plan_buckets,
    resolve_sync_backend,
    unpack,
    wire_tensors,
)


@pytest.mark.parametrize("requested,vllm,colocated,cuda,expected", [
    ("auto", False, False, False, SyncBackend.OBJECT_STORE),  # transformers engines on CPU: today's path
    ("auto", False, True, True, SyncBackend.OBJECT_STORE),
    ("auto", True, False, True, SyncBackend.NCCL),  # vLLM on GPUs of its own
    ("auto", True, True, True, SyncBackend.IPC),  # vLLM on the actor's GPUs
    ("auto", True, False, False, SyncBackend.GLOO),  # vLLM's CPU build
    ("nccl", True, True, True, SyncBackend.IPC),  # OpenRLHF's nccl + colocate_all means CUDA IPC
    ("nccl", True, False, True, SyncBackend.NCCL),
    ("gloo", False, False, False, SyncBackend.GLOO),
    ("gloo", True, True, True, SyncBackend.GLOO),
    ("ipc", True, True, True, SyncBackend.IPC),
    ("object_store", True, False, True, SyncBackend.OBJECT_STORE),
])
def test_the_transport_follows_the_flag_and_the_placement(requested, vllm, colocated, cuda, expected):
    assert resolve_sync_backend(requested, vllm=vllm, colocated=colocated, cuda=cuda) == expected


@pytest.mark.parametrize("requested,colocated,cuda,message", [
    ("nccl", False, False, "sync_backend nccl: .*not all on CUDA"),
    ("ipc", True, False, "sync_backend ipc: .*not all on CUDA"),
    ("ipc", False, True, "sync_backend ipc: the engines do not share the actor's GPUs"),
    ("mpi", False, True, "sync_backend 'mpi': use one of auto, nccl, gloo, ipc, object_store"),
])
def test_impossible_transports_are_config_errors_naming_the_flag(requested, colocated, cuda, message):
    with pytest.raises(ConfigError, match=message):
        resolve_sync_backend(requested, vllm=True, colocated=colocated, cuda=cuda)


def test_tied_weights_travel_once_and_floats_take_the_wire_dtype():
    emb = torch.randn(5, 3)
    state = {"embed.weight": emb, "norm.weight": torch.ones(3), "lm_head.weight": emb, "steps": torch.tensor([4])}
    metas, tensors = wire_tensors(state, "bfloat16")
    assert [m.names for m in metas] == [("embed.weight", "lm_head.weight"), ("norm.weight",), ("steps",)]
    assert [t.dtype for t in tensors] == [torch.bfloat16, torch.bfloat16, torch.int64]  # ints stay ints
    assert torch.equal(tensors[0], emb.to(torch.bfloat16))


def test_buckets_hold_one_dtype_and_respect_the_size():
    f, i = "float32", "int64"
    metas = [TensorMeta(("a",), f, (10,)), TensorMeta(("b",), i, (2,)), TensorMeta(("c",), f, (10,)),
             TensorMeta(("d",), f, (30,)), TensorMeta(("e",), f, (5,))]
    buckets = plan_buckets(metas, bucket_bytes=100)  # 25 floats
    assert buckets == [[0, 2], [1], [3], [4]]  # a+c = 80 B; d alone (120 B > 100); e starts a new one
    assert sorted(i for b in buckets for i in b) == list(range(len(metas)))
    assert all(len({metas[i].dtype for i in b}) == 1 for b in buckets)
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(metas, 0)


def test_pack_and_unpack_round_trip():
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    metas = [TensorMeta((f"t{k}", f"u{k}"), "float32", tuple(t.shape)) for k, t in enumerate(tensors)]
    got = dict(unpack(pack(tensors, "cpu"), metas))
    for k, t in enumerate(tensors):
        assert torch.equal(got[f"t{k}"], t) and torch.equal(got[f"u{k}"], t)
    with pytest.raises(ValueError, match="does not hold"):
        unpack(torch.zeros(3), metas)


# -- processes over gloo ------------------------------------------------------------------------

class TinyLM(torch.nn.Module):
    """Embedding, a block, a norm (with a buffer) and a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.block = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.norm = torch.nn.LayerNorm(32)
        self.register_buffer("scale", torch.ones(32))
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(self.block(self.embed(ids))) * self.scale)


def _tiny_model(seed: int):
    torch.manual_seed(seed)
    return TinyLM()


def _plain(state):
    """Plain numpy copies: a tensor through a multiprocessing queue is a handle to the sender's memory."""
    return {k: v.detach().clone().numpy() for k, v in state.items()}


def _tied(model) -> bool:
    return model.head.weight.data_ptr() == model.embed.weight.data_ptr()


def _actor(port, world_size, timeout_s, out):
    from rlhf_core.rollout.weight_sync import SyncGroup, send_broadcast

    torch.set_num_threads(1)
    model = _tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    optimizer.step()  # a training step: the weights move
    try:
        group = SyncGroup("gloo", "127.0.0.1", port, 0, world_size, timeout_s)
        start = time.monotonic()
        sent = send_broadcast(group, model.state_dict(), bucket_bytes=4_000)  # several buckets
        out.put(("actor", "sent", sent, time.monotonic() - start, _plain(model.state_dict())))
    except Exception as e:  # noqa: BLE001 (reported to the test)
        out.put(("actor", "error", repr(e), time.monotonic() - start, None))


def _engine(rank, port, world_size, timeout_s, out, stuck):
    from rlhf_core.rollout.weight_sync import SyncGroup, receive_broadcast

    torch.set_num_threads(1)
    model = _tiny_model(seed=100 + rank)  # its own (wrong) weights until the sync
    group = SyncGroup("gloo", "127.0.0.1", port, rank, world_size, timeout_s)
    if stuck:
        time.sleep(timeout_s + 20)
        return
    received = {}
    start = time.monotonic()
    try:
        count = receive_broadcast(group, received.update)
    except Exception as e:  # noqa: BLE001 (reported to the test)
        out.put((f"engine{rank}", "error", repr(e), time.monotonic() - start, None))
        return
    model.load_state_dict(received)
    out.put((f"engine{rank}", "received", count, _plain(model.state_dict()), _tied(model)))


def _run(stuck_rank: int | None, timeout_s: float, expect: int):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port, world_size = rendezvous_port(), 3
    procs = [ctx.Process(target=_actor, args=(port, world_size, timeout_s, out))]
    procs += [ctx.Process(target=_engine, args=(r, port, world_size, timeout_s, out, r == stuck_rank))
              for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(expect):
            who, *rest = out.get(timeout=120)
            results[who] = rest
        return results
    finally:
        for p in procs:
            p.kill()
            p.join(10)


def test_gloo_broadcast_leaves_every_engine_with_the_trained_weights():
    results = _run(stuck_rank=None, timeout_s=60, expect=3)
    status, sent, _, actor_state = results["actor"]
    assert status == "sent" and sent > 0
    before = _tiny_model(seed=101).state_dict()
    actor_state = {k: torch.from_numpy(v) for k, v in actor_state.items()}
    assert not all(torch.equal(before[k], actor_state[k]) for k in actor_state)  # the sync has work to do
    for engine in ("engine1", "engine2"):
        status, count, state, tied = results[engine]
        assert status == "received" and count == len(actor_state) - 1  # the tied head travelled once
        assert state.keys() == actor_state.keys()
        assert all(torch.equal(torch.from_numpy(state[k]), actor_state[k]) for k in actor_state), engine
        assert tied  # the engine's head and embedding are still one tensor


def test_a_receiver_that_never_joins_fails_the_others_within_the_deadline():
    results = _run(stuck_rank=2, timeout_s=4, expect=2)  # the actor and engine 1 report; engine 2 hangs
    for who in ("actor", "engine1"):  # the sender waits on engine 2; engine 1 waits on the sender: no hang
        status, error, elapsed, _ = results[who]
        # Engine 1 times out too, or, when the sender timed out first and its process ended, hears
        # the connection close: a failure within the bound either way.
        ended = "imed out" in error or (who == "engine1" and "Connection closed by peer" in error)
        assert status == "error" and ended, (who, error)
        assert elapsed < 4 + 10, (who, elapsed)


def test_both_flag_eras_set_the_sync_and_a_wrong_value_names_the_flag(capsys):
    import argparse
    import shlex

    from rlhf_core.rl_config import add_ppo_flags, build_ppo_config

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    add_ppo_flags(parser)

    def build(flags: str):
        values = vars(parser.parse_args(shlex.split("--pretrain m --task addition --prompt_data json@d "
                                                    "--save_path o --rollout_batch_size 8 --train_batch_size 8 "
                                                    + flags)))
        values.pop("config", None)
        return build_ppo_config(None, values)

    assert build("").vllm.sync_backend == "auto" and build("").vllm.sync_bucket_mb == 512
    dotted = build("--vllm.sync_backend gloo --vllm.sync_bucket_mb 64")
    assert dotted.model_dump() == build("--vllm_sync_backend gloo --vllm_sync_bucket_mb 64").model_dump()
    assert dotted.vllm.sync_backend == "gloo" and dotted.vllm.sync_bucket_mb == 64
    with pytest.raises(SystemExit) as exit_:
        build("--vllm.sync_backend mpi")
    assert exit_.value.code == 2 and "--vllm.sync_backend" in capsys.readouterr().err


def test_a_tied_output_head_is_left_out_only_for_a_model_without_one():
    """With tied embeddings the state dict names the embedding twice (`lm_head.weight` too). A vLLM
    model without a head module (Gemma-2) refuses the second name, so it is left out there; one
    with a tied head gets it (tests/integration/test_model_families.py: the engine then samples with
    the new embedding)."""
    from rlhf_core.rollout.vllm_engine import without_tied_head

    embed = torch.zeros(4, 2)
    items = [("model.embed_tokens.weight", embed), ("model.norm.weight", torch.ones(2)), ("lm_head.weight", embed)]
    assert [n for n, _ in without_tied_head(items)] == ["model.embed_tokens.weight", "model.norm.weight"]


def test_a_mixture_of_experts_is_sent_to_vllm_as_its_checkpoint_holds_it(tmp_path):
    """transformers 5 fuses Mixtral's per-expert matrices in memory; vLLM loads the checkpoint's
    per-expert tensors. What the actor sends with `checkpoint_format` is what `save_pretrained`
    writes, name for name and value for value (a plain Llama's state dict comes back unchanged)."""
    from safetensors.torch import load_file

    from rlhf_core.models.families import build_family_model, get_family, train_family_tokenizer
    from rlhf_core.models.loading import checkpoint_state_dict

    family = get_family("mixtral")
    model = build_family_model(family, train_family_tokenizer(family, ["sort: QWE", "EQW"] * 20, 300))
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    sent = checkpoint_state_dict(model, model.state_dict())
    assert set(sent) == set(saved) and any(".experts.0.w1." in k for k in sent)
    assert all(torch.equal(sent[k], saved[k]) for k in saved)
    assert set(model.state_dict()) != set(saved)  # the in-memory form differs: the conversion is needed


def test_a_cpu_engine_kv_cache_is_sized_for_the_model_and_too_little_memory_names_the_flag():
    """256 sequences of the model's full length, at most the utilization's share of free memory; less
    than one sequence is a configuration error naming --vllm.gpu_memory_utilization (exit 2)."""
    from types import SimpleNamespace

    from rlhf_core.infra.settings import ConfigError
    from rlhf_core.rollout.vllm_engine import cpu_kv_cache_bytes

    config = SimpleNamespace(num_attention_heads=4, hidden_size=128, num_key_value_heads=2, num_hidden_layers=4,
                             max_position_embeddings=256)
    per_token = 2 * 4 * 2 * 32 * 4  # K and V, layers, kv heads, head dim, fp32
    assert cpu_kv_cache_bytes(config, 4, 24 * 2**30, 0.4) == 256 * 256 * per_token
    assert cpu_kv_cache_bytes(config, 4, 10 * 2**20, 0.5) == 5 * 2**20  # capped by memory
    with pytest.raises(ConfigError, match=r"--vllm.gpu_memory_utilization 0.01: .* needs 0.5 MiB.* gives 0.1 MiB"):
        cpu_kv_cache_bytes(config, 4, 10 * 2**20, 0.01)


def test_the_lines_every_weight_update_logs_are_dropped_and_a_real_failure_still_warns(caplog):
    """vLLM warns `RotaryEmbedding: Failed to load weights` at every update (its rotary table is
    computed, no state dict holds it) and logs the prefix-cache reset we ask for: both dropped; a
    layer of another kind that loads nothing still warns, and other lines pass."""
    import logging

    from rlhf_core.rollout.vllm_engine import RELOAD_LOGGERS, quiet_expected_reload_lines

    quiet_expected_reload_lines()
    quiet_expected_reload_lines()  # idempotent: one filter per logger
    layerwise, blocks = (logging.getLogger(name) for name in RELOAD_LOGGERS)
    assert len(layerwise.filters) == len(blocks.filters) == 1
    with caplog.at_level(logging.INFO):
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
        blocks.info("Successfully reset prefix cache")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")
        blocks.info("Failed to reset prefix cache because some blocks (3) are not freed yet")
    assert [r.getMessage() for r in caplog.records] == [
        "QKVParallelLinear: Failed to load weights",
        "Failed to reset prefix cache because some blocks (3) are not freed yet"]
