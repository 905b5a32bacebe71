"""Servers the integration tests share, all on 127.0.0.1."""

import os
import socket
import subprocess
import sys
import time

import pytest


@pytest.fixture(scope="session")
def s3_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
                      AWS_DEFAULT_REGION="us-east-1")
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"the moto S3 server did not listen on 127.0.0.1:{port} within 30 s "
                            f"(exit code {proc.poll()}); is moto[server] installed?")
            time.sleep(0.2)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="models")
    yield endpoint
    proc.terminate()
    proc.wait(10)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


