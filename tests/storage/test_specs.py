"""Storage specs and options are checked when a store opens: a malformed one is InvalidArgument naming the bad part,
raised before anything is made or connected; a well-formed one reaches redis-py as it was meant."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import redis
from helpers.storage import GEOMETRY, RedisServer, namespace, random_pages, read_pages

from kvtier.cache import page_keys
from kvtier.errors import InvalidArgument
from kvtier.storage import FileStore, RedisStore, open_store

HOST = "redis://127.0.0.1:6379"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """A refused spec must not reach the network (a connect attempt fails the test) nor make anything (in an empty
    working directory, checked afterwards)."""
    def connect(self, address):
        raise AssertionError(f"connected to {address} while opening a store")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.chdir(tmp_path)
    yield
    assert list(tmp_path.iterdir()) == [], "a refused spec made something"


@pytest.mark.parametrize("url, words", [
    (f"{HOST}/notanumber", "the path '/notanumber' must be a database number"),
    (f"{HOST}/0/extra", "the path '/0/extra' must be a database number"),
    (f"{HOST}/-1", "the path '/-1' must be a database number"),
    (f"{HOST}/1/2", "the path '/1/2' must be a database number"),
    (f"{HOST}/0;x", "the path '/0;x' must be a database number"),
    (f"{HOST}/99999999999", "the path '/99999999999' must be a database number"),
    (f"{HOST}/0?db=1", "the database is given both in the path and as ?db="),
    (f"{HOST}?db=x", "db='x': expected a whole number >= 0"),
    (f"{HOST}?db=", "db='': expected a whole number >= 0"),
    (f"{HOST}/0?socket_timeout=abc", "socket_timeout='abc': expected a finite number of seconds > 0"),
    (f"{HOST}/0?socket_timeout=-1", "socket_timeout='-1': expected a finite number of seconds > 0"),
    (f"{HOST}/0?socket_timeout=inf", "socket_timeout='inf': expected a finite number of seconds > 0"),
    (f"{HOST}/0?socket_connect_timeout=0", "socket_connect_timeout='0': expected a finite number"),
    (f"{HOST}/0?socket_keepalive=maybe", "socket_keepalive='maybe': expected one of true, yes, on, 1, false"),
    (f"{HOST}/0?health_check_interval=30", "unknown option 'health_check_interval'"),
    (f"{HOST}/0?client_name=two%20words", "client_name='two words': expected printable ASCII without spaces"),
    (f"{HOST}/0?password=", "password='': expected not empty"),
    (f"{HOST}/0?socket_timeout=1&socket_timeout=2", "the option 'socket_timeout' is given twice"),
    (f"{HOST}/0?socket_timeout", "is not name=value pairs"),
    (f"{HOST}/0?bogus=1", "unknown option 'bogus'; kvtier takes client_name, db, password, "
                          "socket_connect_timeout, socket_keepalive, socket_timeout, username"),
    (f"{HOST}/0?decode_responses=true", "unknown option 'decode_responses'"),
    (f"{HOST}/0?retry_on_timeout=true", "unknown option 'retry_on_timeout'"),
    (f"{HOST}/0?ssl_ca_certs=/etc/hostname", "ssl_ca_certs is a TLS option; TLS needs a rediss:// URL"),
    (f"{HOST}/0#frag", "a URL fragment"),
    ("redis://u:p@127.0.0.1:6379/0?password=q", "give the user and password once"),
    ("redis+cluster://127.0.0.1:7000/3", "a cluster URL takes no path"),
    ("redis+cluster://127.0.0.1:7000/0", "a cluster URL takes no path"),
    ("redis+cluster://127.0.0.1:7000?db=0", "a Redis Cluster has only db 0"),
    ("rediss+cluster://127.0.0.1:7000/cluster/3", "a cluster URL takes no path"),
    ("unix://", "unix:// needs the socket's path"),
    ("unix:///", "unix:// needs the socket's path"),
    ("unix://localhost/tmp/redis.sock", "a unix socket URL names no host"),
    ("unix:///tmp/redis.sock?db=x", "db='x': expected a whole number"),
    ("redis:127.0.0.1:6379", "expected scheme://…, e.g. redis://host:6379/0"),
    ("redis://127.0.0.1:0/0", "names no host (or port 0)"),
    ("redis://127.0.0.1\0:6379/0", "storage spec 'redis://127.0.0.1\\x00:6379/0' holds a control character"),
    ("redis://127.0.0.1:6379/0?client_name=a b", "spaces and control characters must be %-encoded"),
])
def test_a_malformed_redis_url_is_refused_naming_the_bad_part(offline, url, words):
    with pytest.raises(InvalidArgument, match=_escaped(words)):
        open_store(url, namespace())


def test_cluster_true_on_a_unix_socket_or_false_on_a_cluster_url_is_refused():
    with pytest.raises(InvalidArgument, match="a Redis Cluster is not reached through a unix socket"):
        RedisStore("unix:///tmp/redis.sock", namespace(), cluster=True)
    with pytest.raises(InvalidArgument, match="cluster=False contradicts its redis\\+cluster:// scheme"):
        RedisStore("redis+cluster://127.0.0.1:7000", namespace(), cluster=False)
    with pytest.raises(InvalidArgument, match="a cluster URL takes no path"):
        RedisStore(f"{HOST}/2", namespace(), cluster=True)


def test_a_control_character_in_a_url_given_to_the_store_itself_is_refused(offline):
    with pytest.raises(InvalidArgument, match="spaces and control characters must be %-encoded"):
        RedisStore("redis://127.0.0.1\0:6379/0", namespace())


def test_passwords_never_appear_in_a_message(offline):
    with pytest.raises(InvalidArgument) as refused:
        open_store("redis://kv:s3cret@127.0.0.1:6379/x?password=", namespace())
    assert "s3cret" not in str(refused.value) and "kv:***@127.0.0.1" in str(refused.value)
    with pytest.raises(InvalidArgument) as refused:
        open_store("rediss://127.0.0.1:6379/0?ssl_password=hunter2&ssl_keyfile=/nonexistent", namespace())
    assert "hunter2" not in str(refused.value) and "ssl_password=***" in str(refused.value)
    for spec in ("redis://kv:s3cret@127.0.0.1:6379/0 ", "redis://kv:s3cret@127.0.0.1:6379/0\n"):
        with pytest.raises(InvalidArgument) as refused:
            open_store(spec, namespace())
        assert "s3cret" not in str(refused.value)
    with pytest.raises(InvalidArgument) as refused:
        open_store("redis://kv:s3cret@127.0.0.1:6379/0", namespace(), max_bytes=1)
    assert "s3cret" not in str(refused.value) and "unknown option 'max_bytes'" in str(refused.value)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate and its key (for the TLS options), and a file that is neither."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a certificate)")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    garbage = folder / "garbage.pem"
    garbage.write_text("not a certificate\n")
    return {"cert": str(cert), "key": str(key), "garbage": str(garbage), "folder": str(folder)}


@pytest.mark.parametrize("query, words", [
    ("ssl_cert_reqs=maybe", "ssl_cert_reqs='maybe': expected one of none, optional, required"),
    ("ssl_check_hostname=perhaps", "ssl_check_hostname='perhaps': expected one of true"),
    ("ssl_ca_certs=/nonexistent/ca.pem", "ssl_ca_certs='/nonexistent/ca.pem': expected no such file"),
    ("ssl_ca_certs={garbage}", "ssl_ca_certs refused by the TLS library"),
    ("ssl_ca_path=/nonexistent", "ssl_ca_path='/nonexistent': expected no such directory"),
    ("ssl_certfile={garbage}", "ssl_certfile refused by the TLS library"),
    ("ssl_certfile={cert}&ssl_keyfile={garbage}", "ssl_certfile with ssl_keyfile refused by the TLS library"),
    ("ssl_keyfile={key}", "ssl_keyfile needs ssl_certfile"),
    ("ssl_password=x", "ssl_password unlocks ssl_keyfile; no ssl_certfile is given"),
    ("ssl_min_version=TLSv9", "ssl_min_version='TLSv9': expected one of TLSv1_2, TLSv1_3"),
    ("ssl_ciphers=NO-SUCH-CIPHER", "ssl_ciphers refused by the TLS library"),
    ("ssl_cert_reqs=none&ssl_check_hostname=true", "ssl_check_hostname=true needs certificate checks"),
    ("ssl_validate_ocsp=true", "unknown option 'ssl_validate_ocsp'; kvtier takes client_name, db, "
                               "password, socket_connect_timeout, socket_keepalive, "
                               "socket_timeout, ssl_ca_certs, ssl_ca_path, ssl_cert_reqs, ssl_certfile, "
                               "ssl_check_hostname, ssl_ciphers, ssl_keyfile, ssl_min_version, ssl_password, "
                               "username"),
])
def test_bad_tls_options_are_refused_at_open(offline, certificate, query, words):
    url = f"rediss://127.0.0.1:6380/0?{query.format(**certificate)}"
    with pytest.raises(InvalidArgument, match=_escaped(words)):
        open_store(url, namespace())


def test_good_tls_options_open_and_reach_redis_py(certificate):
    url = (f"rediss+cluster://127.0.0.1:7000?ssl_ca_certs={certificate['cert']}&ssl_certfile={certificate['cert']}"
           f"&ssl_keyfile={certificate['key']}&ssl_min_version=TLSv1_2&ssl_check_hostname=false"
           f"&ssl_ca_path={certificate['folder']}&ssl_ciphers=HIGH&ssl_cert_reqs=optional")
    store = RedisStore(url, namespace())
    assert store.cluster and store.url == "rediss://127.0.0.1:7000" and "ssl" not in store.url
    assert store._options["ssl_min_version"] == 771 and store._options["ssl_check_hostname"] is False
    assert store._options["ssl_cert_reqs"] == 1
    store.close()


@pytest.mark.parametrize("spec, options, words", [
    ("file:{tmp}", {"max_byte": 10**9}, "unknown option 'max_byte' for a file store; it takes batch_pages, fsync, "
                                        "io_threads, layout, max_bytes, overwrite, retry_interval"),
    ("file:{tmp}", {"ttl": 5}, "unknown option 'ttl' for a file store"),
    ("file:{tmp}", {"timeout": 5}, "unknown option 'timeout' for a file store"),
    ("memory:", {"fsync": "data"}, "unknown option 'fsync' for a memory store; it takes batch_pages, io_threads, "
                                   "layout, max_bytes, retry_interval, shared"),
    (HOST + "/0", {"max_bytes": 5}, "unknown option 'max_bytes' for a redis store; it takes batch_pages, cluster, "
                                    "connect_timeout, io_threads, layout, prefix, retry_interval, timeout, ttl"),
    ("file:{tmp}", {"fsync": None}, "fsync=None: choose one of none, data, full"),
    ("file:{tmp}", {"fsync": ["data"]}, "fsync=['data']: choose one of none, data, full"),
    ("file:{tmp}", {"overwrite": "yes"}, "overwrite='yes': True or False"),
    ("file:{tmp}", {"max_bytes": "1G"}, "max_bytes='1G' must be an int"),
    ("file:{tmp}", {"layout": "rows"}, "unknown host layout 'rows'"),
    ("file:{tmp}", {"io_threads": 0}, "io_threads=0: an int >= 1"),
    (HOST + "/0", {"cluster": "no"}, "cluster='no': True, False or None"),
    (HOST + "/0", {"prefix": 5}, "prefix=5: a non-empty name without ':'"),
    (HOST + "/0", {"ttl": 1.5}, "ttl=1.5: whole seconds >= 1"),
    (HOST + "/0?socket_timeout=1", {"timeout": 2}, "timeout=2 and the URL's socket_timeout: give it once"),
    (HOST + "/0?socket_connect_timeout=1", {"connect_timeout": 1},
     "connect_timeout=1 and the URL's socket_connect_timeout: give it once"),
])
def test_an_option_of_the_wrong_name_or_type_is_refused_by_name(offline, tmp_path, spec, options, words):
    with pytest.raises(InvalidArgument, match=_escaped(words)):
        open_store(spec.format(tmp=tmp_path / "store"), namespace(), **options)


def test_a_namespace_that_is_not_one_is_refused(tmp_path):
    for spec in (f"file:{tmp_path / 'store'}", "memory:", HOST + "/0"):
        with pytest.raises(InvalidArgument, match="namespace='model-x': a kvtier.cache.Namespace, or None"):
            open_store(spec, "model-x")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("spec, words", [
    ("bogus:x", "unknown scheme 'bogus'"),
    ("x:y", "unknown scheme 'x'"),
    ("http://host/x", "unknown scheme 'http'"),
    ("File:store", "unknown scheme 'File'"),
    ("store", "has no scheme: for a directory write file:store"),
    ("./store", "has no scheme: for a directory write file:./store"),
    ("{tmp}/store", "has no scheme: for a directory write file:{tmp}/store"),
    (" file:store", "remove the spaces around it"),
    ("file:store ", "remove the spaces around it"),
    ("file:", "file: needs a directory"),
    ("file://", "file: needs a directory"),
    ("file://host/store", "a file store is local; write file:///abs/path or file:PATH"),
    ("file:store?max_bytes=1000000", "a file store takes its options as keywords of open_store"),
    ("memory:x", "memory: takes nothing after the colon"),
    ("", "storage spec '': expected file:PATH"),
    ("file:store\0x", "storage spec 'file:store\\x00x' holds a control character"),
    ("file:store\nx", "storage spec 'file:store\\nx' holds a control character"),
])
def test_an_unknown_scheme_or_a_bare_path_is_refused_and_nothing_is_made(tmp_path, monkeypatch, spec, words):
    monkeypatch.chdir(tmp_path)
    spec, words = spec.format(tmp=tmp_path), words.format(tmp=tmp_path)
    with pytest.raises(InvalidArgument, match=_escaped(words)):
        open_store(spec, namespace())
    assert list(tmp_path.iterdir()) == [], "a refused spec made something"


def test_a_spec_or_root_that_is_not_a_string_is_refused():
    with pytest.raises(InvalidArgument, match="storage spec PosixPath"):
        open_store(Path("/tmp/x"), namespace())
    for root in (5, "", "/tmp/a\0b"):
        with pytest.raises(InvalidArgument, match="file store root .*: a directory path"):
            FileStore(root, namespace())


def test_file_specs_in_url_form_and_with_a_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    ns = namespace()
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    pages = random_pages(2)
    with open_store(f"file://{tmp_path}/url-form", ns) as store:
        assert isinstance(store, FileStore) and store.root == tmp_path / "url-form"
        assert store.set(keys, [[p] for p in pages]) == 2
    with open_store(f"file:{tmp_path}/url-form", ns) as store:
        count, out = read_pages(store, keys)
        assert count == 2 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True))
    with open_store("file:~/kvtier", ns) as store:
        assert store.root == tmp_path / "home" / "kvtier" and (store.directory / "namespace.json").is_file()


def test_url_options_reach_the_server():
    """client_name, timeouts and keepalive from the query are what the connection uses."""
    server = RedisServer()
    try:
        ns = namespace()
        url = (f"redis://127.0.0.1:{server.port}/3?client_name=kvtier-spec-test&socket_timeout=4.5"
               "&socket_connect_timeout=1.5&socket_keepalive=yes")
        with open_store(url, ns) as store:
            keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
            assert store.set(keys, [[p] for p in random_pages(2)]) == 2
            connection = store.client().connection_pool.connection_kwargs
            assert (connection["socket_timeout"], connection["socket_connect_timeout"]) == (4.5, 1.5)
            assert connection["socket_keepalive"] is True
            names = [c["name"] for c in redis.Redis(port=server.port).client_list()]
            assert "kvtier-spec-test" in names
        in_db3 = redis.Redis(port=server.port, db=3)
        assert in_db3.exists(store.key(keys[0]), store.key(keys[1])) == 2
        assert redis.Redis(port=server.port, db=0).dbsize() == 0
    finally:
        server.close()


def test_url_options_reach_every_cluster_node(redis_cluster_url):
    ns = namespace()
    keys = page_keys(ns, np.arange(30 * GEOMETRY.page_size))
    pages = random_pages(30)
    with open_store(f"{redis_cluster_url}?socket_timeout=3.5&client_name=kvtier-cluster-test", ns) as store:
        assert store.set(keys, [[p] for p in pages]) == 30
        count, out = read_pages(store, keys)
        assert count == 30 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True))
        for node in store.client().get_primaries():
            assert node.redis_connection.connection_pool.connection_kwargs["socket_timeout"] == 3.5
            assert "kvtier-cluster-test" in [c["name"] for c in node.redis_connection.client_list()]
        store.clear()


def test_a_unix_socket_with_a_db_and_a_password_in_the_query(tmp_path):
    sock = tmp_path / "redis.sock"
    server = RedisServer("--unixsocket", str(sock), "--unixsocketperm", "700", "--requirepass", "s3cret")
    try:
        ns = namespace()
        keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
        pages = random_pages(3)
        with open_store(f"unix://{sock}?db=2&password=s3cret", ns) as store:
            assert store.set(keys, [[p] for p in pages]) == 3
            count, out = read_pages(store, keys)
            assert count == 3 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True))
            assert store.stats().get("errors.set", 0) == 0
        raw = redis.Redis(unix_socket_path=str(sock), password="s3cret", db=2)
        assert raw.exists(*(store.key(k) for k in keys)) == 3
    finally:
        server.close()


def _escaped(words: str) -> str:
    return re.escape(words)


@pytest.mark.parametrize("spec, options, words", [
    ("redis://127.0.0.1:abc/0", {}, "Port could not be cast"),
    ("redis://127.0.0.1:99999/0", {}, "out of range"),
    ("redis:///0", {}, "names no host"),
    ("redis://127.0.0.1:6379/0", {"timeout": -1}, "timeout=-1"),
    ("redis://127.0.0.1:6379/0", {"timeout": float("nan")}, "timeout=nan"),
    ("redis://127.0.0.1:6379/0", {"connect_timeout": "soon"}, "connect_timeout='soon'"),
    ("redis://127.0.0.1:6379/0", {"retry_interval": "1"}, "retry_interval='1'"),
    ("redis://127.0.0.1:6379/0", {"batch_pages": float("nan")}, "batch_pages=nan"),
    ("memory:foo", {}, "memory: takes nothing"),
    ("memory:", {"max_bytes": -5}, "max_bytes=-5"),
])
def test_bad_urls_and_options_are_refused_when_the_store_opens(spec, options, words):
    with pytest.raises(InvalidArgument, match=words.replace("(", r"\(")):
        open_store(spec, namespace(), **options)
