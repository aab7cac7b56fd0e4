"""The fault-injecting S3 proxy of the test bed (``tests/testbed/s3proxy.py``), checked
against the real S3 server (moto on 127.0.0.1): what passes through is unchanged, and
each fault does what it claims (the store did or did not get the request)."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import http.client
import threading

import pytest
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3 import boto3_client
from tests.testbed.s3proxy import Rule, S3Proxy, classify

pytestmark = pytest.mark.netfs


@pytest.fixture
def proxy(s3_server):
    with S3Proxy(s3_server, lifetime_s=120) as p:
        yield p


def client(proxy: S3Proxy, attempts: int = 1):
    from botocore.config import Config

    config = Config(retries={"total_max_attempts": attempts, "mode": "legacy"})
    return boto3_client(proxy.endpoint_url, config=config)


def exists(s3_server, bucket: str, key: str) -> bool:
    listed = s3_server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=key)
    return any(o["Key"] == key for o in listed.get("Contents", []))


def test_classify_names_every_request_type():
    cases = {
        ("PUT", "/b/k", ()): "put",
        ("PUT", "/b/k", (("if-none-match", "*"),)): "put-create",
        ("PUT", "/b/k", (("if-match", '"e"'),)): "put-conditional",
        ("PUT", "/b/k?partNumber=1&uploadId=u", ()): "part",
        ("PUT", "/b/k", (("x-amz-copy-source", "/b/j"),)): "copy",
        ("POST", "/b/k?uploads", ()): "mpu-start",
        ("POST", "/b/k?uploadId=u", ()): "mpu-complete",
        ("DELETE", "/b/k?uploadId=u", ()): "mpu-abort",
        ("DELETE", "/b/k", ()): "delete",
        ("POST", "/b?delete", ()): "delete-many",
        ("GET", "/b?list-type=2&prefix=p", ()): "list",
        ("GET", "/b?uploads", ()): "list-uploads",
        ("HEAD", "/b/k", ()): "head",
        ("HEAD", "/b", ()): "head-bucket",
        ("GET", "/b/a%20b/c", ()): "get",
    }
    for (method, path, headers), kind in cases.items():
        assert classify(method, path, dict(headers))[0] == kind, (method, path)
    assert classify("GET", "/b/a%20b/c", {})[1:] == ("b", "a b/c")


@pytest.mark.timeout(60)
def test_requests_pass_through_unchanged_and_are_logged(s3_server, s3_bucket, proxy):
    import s3fs

    fs = s3fs.S3FileSystem(**proxy.storage_options(), skip_instance_cache=True)
    fs.pipe(f"{s3_bucket}/p/small", b"hello")
    with fs.open(f"{s3_bucket}/p/big", "wb", block_size=5 << 20) as f:
        f.write(b"x" * (11 << 20))  # a multipart upload: start, parts, complete
    assert fs.cat(f"{s3_bucket}/p/small") == b"hello"
    assert fs.size(f"{s3_bucket}/p/big") == 11 << 20
    assert sorted(fs.ls(f"{s3_bucket}/p")) == [f"{s3_bucket}/p/big", f"{s3_bucket}/p/small"]
    fs.rm(f"{s3_bucket}/p", recursive=True)
    assert not exists(s3_server, s3_bucket, "p/small")
    kinds = {r.kind for r in proxy.requests}
    assert {"put", "mpu-start", "part", "mpu-complete", "get", "list", "delete-many"} <= kinds
    assert not proxy.injected


@pytest.mark.timeout(60)
def test_error_answers_without_forwarding(s3_server, s3_bucket, proxy):
    from botocore.exceptions import ClientError

    c = client(proxy)
    rule = proxy.add(Rule("error", status=503, method="PUT", key="^e/"))
    with pytest.raises(ClientError) as err:
        c.put_object(Bucket=s3_bucket, Key="e/1", Body=b"x")
    assert err.value.response["Error"]["Code"] == "SlowDown"
    assert not exists(s3_server, s3_bucket, "e/1")
    # once: the next one passes; a retrying client never notices a single 500.
    proxy.add(Rule("error", status=500, method="PUT", key="^e/"))
    client(proxy, attempts=3).put_object(Bucket=s3_bucket, Key="e/2", Body=b"x")
    assert exists(s3_server, s3_bucket, "e/2")
    assert rule.fired == 1 and proxy.counts() == {"error put": 2}
    # A 412 on a conditional create reads as "exists", as the store's own would.
    proxy.add(Rule("error", status=412, kind="put-create"))
    with pytest.raises(ClientError) as err:
        c.put_object(Bucket=s3_bucket, Key="e/3", Body=b"x", IfNoneMatch="*")
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert err.value.response["Error"].get("Condition") == "If-None-Match"


@pytest.mark.timeout(60)
def test_drop_lands_the_request_and_loses_the_answer(s3_server, s3_bucket, proxy):
    from botocore.exceptions import BotoCoreError, ClientError

    rule = proxy.add(Rule("drop", kind="put-create", key="^d/"))
    with pytest.raises((BotoCoreError, ClientError)):
        client(proxy).put_object(Bucket=s3_bucket, Key="d/1", Body=b"landed", IfNoneMatch="*")
    assert rule.done.is_set() and exists(s3_server, s3_bucket, "d/1")
    # A retrying client sends it again, and the store refuses its own first create.
    proxy.add(Rule("drop", kind="put-create", key="^d/"))
    with pytest.raises(ClientError) as err:
        client(proxy, attempts=2).put_object(
            Bucket=s3_bucket, Key="d/2", Body=b"x", IfNoneMatch="*"
        )
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert exists(s3_server, s3_bucket, "d/2")


@pytest.mark.timeout(60)
def test_cut_stops_an_upload_before_it_lands(s3_server, s3_bucket, proxy):
    from botocore.exceptions import BotoCoreError, ClientError

    rule = proxy.add(Rule("cut", method="PUT", key="^c/"))
    with pytest.raises((BotoCoreError, ClientError)):
        client(proxy).put_object(Bucket=s3_bucket, Key="c/1", Body=b"y" * 100_000)
    assert rule.fired == 1 and not exists(s3_server, s3_bucket, "c/1")


@pytest.mark.timeout(60)
def test_strip_makes_a_store_that_ignores_if_none_match(s3_server, s3_bucket, proxy):
    c = client(proxy)
    c.put_object(Bucket=s3_bucket, Key="s/1", Body=b"first", IfNoneMatch="*")
    proxy.add(Rule("strip", kind="put-create", header="If-None-Match"))
    c.put_object(Bucket=s3_bucket, Key="s/1", Body=b"second", IfNoneMatch="*")  # no 412
    body = s3_server.boto3_client().get_object(Bucket=s3_bucket, Key="s/1")["Body"].read()
    assert body == b"second"


@pytest.mark.timeout(60)
def test_delay_holds_a_request_until_released(s3_server, s3_bucket, proxy):
    rule = proxy.add(Rule("delay", method="PUT", key="^h/"))
    done = threading.Event()

    def put() -> None:
        client(proxy).put_object(Bucket=s3_bucket, Key="h/1", Body=b"late")
        done.set()

    t = threading.Thread(target=put)
    t.start()
    assert rule.arrived.wait(30)
    assert not exists(s3_server, s3_bucket, "h/1") and not done.is_set()
    rule.release.set()
    t.join(30)
    # The proxy sets ``done`` just after it has written the answer, so the client can
    # see the answer first: wait for it rather than read it.
    assert done.is_set() and rule.done.wait(10) and exists(s3_server, s3_bucket, "h/1")


@pytest.mark.timeout(60)
def test_close_releases_held_requests(s3_server, s3_bucket):
    with S3Proxy(s3_server) as p:
        rule = p.add(Rule("delay", method="PUT"))
        t = threading.Thread(
            target=lambda: client(p).put_object(Bucket=s3_bucket, Key="z/1", Body=b"z")
        )
        t.start()
        assert rule.arrived.wait(30)
    t.join(30)
    assert not t.is_alive() and exists(s3_server, s3_bucket, "z/1")


@pytest.mark.timeout(60)
def test_chunked_bodies_and_batch_delete_keys(s3_server, s3_bucket, proxy):
    # A body sent with Transfer-Encoding: chunked arrives whole.
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.putrequest("PUT", f"/{s3_bucket}/t/chunked")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    for piece in (b"abc", b"defgh", b""):
        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    assert conn.getresponse().status == 200
    conn.close()
    body = s3_server.boto3_client().get_object(Bucket=s3_bucket, Key="t/chunked")["Body"].read()
    assert body == b"abcdefgh"
    # A rule on a key matches that key inside a batch delete.
    c = client(proxy)
    for k in ("t/a", "t/b"):
        c.put_object(Bucket=s3_bucket, Key=k, Body=b"1")
    rule = proxy.add(Rule("error", status=500, kind="delete-many", key="^t/b$"))
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError):
        c.delete_objects(Bucket=s3_bucket, Delete={"Objects": [{"Key": "t/a"}, {"Key": "t/b"}]})
    assert rule.requests[0].keys == ("t/a", "t/b")
    assert exists(s3_server, s3_bucket, "t/a") and exists(s3_server, s3_bucket, "t/b")
