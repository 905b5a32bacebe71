"""What the GPU tests share: a local Ray for the vLLM engines (skipped where vLLM is not installed)."""

import pytest


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("vllm")
    import ray

    from rlhf_core.distributed.local_ray import init_local

    context = init_local(include_dashboard=False, log_to_driver=False)
    yield context
    ray.shutdown()
