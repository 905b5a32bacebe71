"""Precision: `--param_dtype` (or `--bf16`) resolved by what the hardware computes natively."""

import json

import pytest

from rlhf_core.config import SFTConfig, build_config
from rlhf_core.infra import precision
from rlhf_core.infra.precision import Hardware, Precision, resolve
from rlhf_core.infra.settings import ConfigError

AMX = Hardware("cpu", native_bf16=True, name="Xeon with AMX")
AVX2 = Hardware("cpu", native_bf16=False, name="EPYC, AVX2 only")
A100 = Hardware("cuda", native_bf16=True, name="A100")
V100 = Hardware("cuda", native_bf16=False, name="V100")


@pytest.mark.parametrize(("requested", "hw", "expected", "warns"), [
    ("auto", AMX, "bf16", False), ("auto", AVX2, "fp32", False), ("auto", A100, "bf16", False),
    ("auto", V100, "fp32", False),
    ("bf16", AMX, "bf16", False), ("bf16", AVX2, "fp32", True), ("bf16", V100, "fp32", True),
    ("fp16", A100, "fp16", False), ("fp16", V100, "fp16", False),  # DeepSpeed's fp16 scales the loss
    ("fp16", AMX, "fp32", True), ("fp16", AVX2, "fp32", True),  # the CPU path has no loss scaling
    ("fp32", AMX, "fp32", False), ("fp32", AVX2, "fp32", False), ("fp32", A100, "fp32", False),
])
def test_resolve_picks_native_precision_and_warns_on_every_fallback(requested, hw, expected, warns):
    chosen, warning = resolve(requested, hw)
    assert chosen == Precision(expected) and (warning is not None) == warns
    if warns:
        assert requested in warning and "fp32" in warning


def test_emulated_half_can_be_forced():
    assert resolve("bf16", AVX2, allow_emulated=True) == (Precision.BF16, None)
    assert resolve("auto", AVX2, allow_emulated=True) == (Precision.FP32, None)  # auto still means native


def test_fallback_warning_reaches_stderr_once_on_rank_0(monkeypatch, capsys):
    monkeypatch.setattr(precision, "this_hardware", lambda: AVX2)
    monkeypatch.delenv(precision.EMULATED_HALF_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    precision.resolve_here.cache_clear()
    try:
        assert precision.resolve_here("bf16") == Precision.FP32
        assert precision.resolve_here("bf16") == Precision.FP32
        err = capsys.readouterr().err
        assert err.count("rlhf: warning: bf16 asked for") == 1 and "EPYC, AVX2 only" in err
        precision.resolve_here.cache_clear()
        monkeypatch.setenv("RANK", "1")
        assert precision.resolve_here("bf16") == Precision.FP32 and capsys.readouterr().err == ""
        precision.resolve_here.cache_clear()
        monkeypatch.setenv(precision.EMULATED_HALF_ENV, "1")
        assert precision.resolve_here("bf16") == Precision.BF16
    finally:
        precision.resolve_here.cache_clear()


def test_bf16_flag_is_the_older_spelling_of_param_dtype():
    base = {"pretrain": "m", "save_path": "o", "dataset": "d.jsonl"}
    assert build_config(SFTConfig, None, base).param_dtype == Precision.AUTO
    old = build_config(SFTConfig, None, {**base, "bf16": True})
    new = build_config(SFTConfig, None, {**base, "param_dtype": "bf16"})
    assert old.param_dtype == new.param_dtype == Precision.BF16
    assert old.model_dump() == new.model_dump()  # one spelling, one config (and one config hash)
    assert build_config(SFTConfig, None, {**base, "bf16": True, "param_dtype": "bf16"}).param_dtype == Precision.BF16
    for contradiction in ("fp32", "fp16"):
        with pytest.raises(ConfigError, match=f"--bf16 \\('bf16'\\) and --param_dtype \\('{contradiction}'\\) set "
                                              "--ds.param_dtype to different values"):
            build_config(SFTConfig, None, {**base, "bf16": True, "param_dtype": contradiction})
    with pytest.raises(ConfigError, match="param_dtype"):
        build_config(SFTConfig, None, {**base, "param_dtype": "int8"})


def test_cli_takes_both_spellings_and_rejects_a_contradiction(capsys, tmp_path):
    from rlhf_core.cli import _parser, flag_values, main

    def parsed(*flags):
        args = _parser().parse_args(["train", "sft", *flags])
        return flag_values(args)

    assert parsed("--ds.param_dtype", "fp32") == parsed("--param_dtype", "fp32") == {"ds.param_dtype": "fp32"}
    with pytest.raises(SystemExit) as exc:  # argparse's usage error
        main(["train", "sft", "--pretrain", "m", "--save_path", str(tmp_path / "o"), "--dataset", "d.jsonl",
              "--bf16", "--ds.param_dtype", "fp32"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--param_dtype: --bf16 already set --ds.param_dtype to 'bf16'" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_manifest_records_the_precision_used_and_hashes_it_instead_of_auto():
    from rlhf_core.infra.manifests import config_hash, stage_manifest

    cfg = SFTConfig(pretrain="m", save_path="o")
    bf16 = stage_manifest(cfg, {}, {}, None, precision="bf16")
    fp32 = stage_manifest(cfg, {}, {}, None, precision="fp32")
    assert bf16["precision"] == "bf16" and fp32["precision"] == "fp32"
    assert bf16["config_hash"] != fp32["config_hash"]
    assert fp32["config_hash"] == config_hash(SFTConfig(pretrain="m", save_path="o", param_dtype="fp32"))
    assert json.loads(json.dumps(bf16))["config"]["ds"]["param_dtype"] == "auto"  # what was asked for stays visible


def test_a_cpu_is_named_with_its_family_model_and_matrix_isa():
    """On a cloud VM the model name is often the vendor's line alone ("AMD EPYC"): figures name the
    family, model and ISA beside it, from the first processor's block of /proc/cpuinfo."""
    def block(family, model, flags):
        return f"processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: {family}\nmodel\t\t: {model}\nflags\t\t: {flags}\n"

    assert precision.cpu_details(block(25, 17, "fpu avx2 avx512f avx512_bf16")) == \
        "family 25 model 17, AVX-512 with bf16, no AMX"
    assert precision.cpu_details(block(6, 143, "avx2 avx512f avx512_bf16 amx_bf16 amx_tile")) == "family 6 model 143, AMX"
    assert precision.cpu_details(block(23, 49, "avx2") + "\n" + block(25, 17, "avx512f")) == \
        "family 23 model 49, AVX2, no AVX-512"  # the first block
    assert precision.cpu_details("model name : something\n") == ""


def test_this_machine_reports_what_onednn_reports_and_auto_follows_it():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU's report")
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert precision.this_hardware().native_bf16 == native
    assert f"native bf16: {'yes' if native else 'no'}" in precision.describe_hardware()
    precision.resolve_here.cache_clear()
    try:
        assert precision.resolve_here("auto") == (Precision.BF16 if native else Precision.FP32)
    finally:
        precision.resolve_here.cache_clear()
