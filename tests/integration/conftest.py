"""Servers the integration tests share, all on 127.0.0.1."""

import pytest


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server with bucket `models`; its endpoint and test credentials in the environment."""
    from tests.integration.simulated_cluster import moto_server

    with moto_server() as endpoint:
        yield endpoint


