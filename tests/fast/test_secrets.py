"""Which storage options are credentials: pure logic, no Spark."""

import pytest

import hvd_spark
from hvd_spark._internal.common.secrets import is_secret_name, redacted, split_secrets, url_without_credentials
from hvd_spark._internal.driver.tracking import describe, param_values

OPTIONS = {
    "key": "AKIA-KEY-VALUE",
    "secret": "SECRET-VALUE",
    "token": "TOKEN-VALUE",
    "endpoint_url": "http://minio.internal:9000",
    "anon": False,
    "client_kwargs": {"region_name": "eu-west-1", "aws_secret_access_key": "NESTED-SECRET", "aws_session_token": "ST"},
    "config_kwargs": {"signature_version": "s3v4", "retries": {"max_attempts": 3}},
    "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "KMS-ID"},
    "headers": [{"Authorization": "Bearer HEADER-TOKEN", "Accept": "*/*"}],
    "proxy": "http://user:PROXY-PASSWORD@proxy:3128",
}
SECRET_VALUES = ("AKIA-KEY-VALUE", "SECRET-VALUE", "TOKEN-VALUE", "NESTED-SECRET", "HEADER-TOKEN", "PROXY-PASSWORD")


@pytest.mark.parametrize(
    "name",
    [
        "key", "secret", "token", "password", "passwd", "session_token", "aws_access_key_id",
        "aws_secret_access_key", "account_key", "sas_token", "client_secret", "clientSecret", "credentials",
        "connection_string", "Authorization", "private_key", "passphrase", "SSEKMSKeyId", "api_key",
    ],
)  # fmt: skip
def test_credential_names_are_secret(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "endpoint_url", "region_name", "region", "anon", "use_ssl", "profile", "client_kwargs", "config_kwargs",
        "signature_version", "requester_pays", "account_name", "username", "tenant_id", "max_attempts", 3,
    ],
)  # fmt: skip
def test_settings_are_not_secret(name):
    assert not is_secret_name(name)


def test_split_removes_credentials_at_any_depth_and_names_them():
    public, removed = split_secrets(OPTIONS)
    text = repr(public)
    assert not any(v in text for v in SECRET_VALUES)
    assert public["endpoint_url"] == "http://minio.internal:9000" and public["anon"] is False
    assert public["client_kwargs"] == {"region_name": "eu-west-1"}
    assert public["config_kwargs"] == {"signature_version": "s3v4", "retries": {"max_attempts": 3}}
    assert public["headers"] == [{"Accept": "*/*"}]
    assert sorted(removed) == sorted(
        [
            "key", "secret", "token", "client_kwargs.aws_secret_access_key", "client_kwargs.aws_session_token",
            "s3_additional_kwargs.SSEKMSKeyId", "headers[0].Authorization", "proxy",
        ]
    )  # fmt: skip
    assert OPTIONS["client_kwargs"]["aws_secret_access_key"] == "NESTED-SECRET"  # the input is not changed
    assert split_secrets(None) == ({}, [])


def test_redacted_keeps_the_names_not_the_values():
    shown = redacted(OPTIONS)
    assert not any(v in repr(shown) for v in SECRET_VALUES)
    assert shown["key"] == "***" and shown["client_kwargs"]["aws_secret_access_key"] == "***"
    assert shown["endpoint_url"] == OPTIONS["endpoint_url"]


def test_urls_lose_their_user_and_password():
    assert url_without_credentials("ftp://user:pw@host:21/data") == "ftp://host:21/data"
    assert url_without_credentials("s3://bucket/prefix") == "s3://bucket/prefix"
    assert url_without_credentials("/tmp/with@sign") == "/tmp/with@sign"


def test_a_store_never_shows_its_storage_options(tmp_path):
    store = hvd_spark.Store(str(tmp_path), storage_options={"key": "AKIA-KEY-VALUE", "secret": "SECRET-VALUE"})
    for text in (repr(store), str(store), describe(store), repr(param_values({"store": store}))):
        assert "AKIA-KEY-VALUE" not in text and "SECRET-VALUE" not in text
    assert param_values({"store": "ftp://user:PROXY-PASSWORD@host/x"}) == {"store": "ftp://host/x"}
