"""deployments/prefect.yaml: every deployment's parameters validate and the schedules are there."""

from __future__ import annotations


def test_every_deployment_validates_and_the_schedules_are_there():
    from pathlib import Path

    import yaml

    from flows.cli import flow_parameters

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "deployments" / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert {"full-pipeline", "sft", "reward-model", "prm", "dpo", "ppo", "rejection-sampling", "conditional-sft", "distill", "eval", "iterative-dpo", "online-rl",
            "rejection-sampling-rounds"} <= \
        set(deployments)
    for name, d in deployments.items():
        params = flow_parameters(d.get("parameters") or {})
        assert d["entrypoint"] == "flows/pipeline.py:rlhf", name
        if name == "full-pipeline":
            assert [s.value for s in params["settings"].stages] == ["prep", "sft", "rm", "ppo", "eval"]
    assert deployments["ppo"]["parameters"]["settings"]["stages"] == ["ppo"]
    assert deployments["online-rl"]["parameters"]["settings"] == {"stages": ["online_rl"], "from_run": "champion"}
    assert deployments["iterative-dpo"]["schedules"][0]["cron"] == "0 3 * * *"
    assert deployments["online-rl"]["schedules"][0]["active"]
    assert flow_parameters(deployments["online-rl"]["parameters"])["online"].reward == "verifier"  # it earns its schedule
    rounds = deployments["rejection-sampling-rounds"]
    assert rounds["schedules"][0]["cron"] == "0 5 * * *" and rounds["schedules"][0]["active"]
    params = flow_parameters(rounds["parameters"])
    assert params["settings"].from_run == "champion"
    assert (params["rejection_sampling"].start_from, params["rejection_sampling"].reward) == ("champion", "verifier")
