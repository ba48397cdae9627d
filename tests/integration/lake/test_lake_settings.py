"""One configuration of the lake for every client: the spec's non-secret settings over the
environment's, as obstore, pyiceberg and DuckDB take them."""

from __future__ import annotations

from batchline.lake import lake_settings
from batchline.sources.iceberg import pyiceberg_properties

ENV = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_REGION": "eu-west-1",
       "AWS_SECRET_ACCESS_KEY": "never-copied", "STORAGE_EMULATOR_HOST": "127.0.0.1:4443"}


def test_the_environment_gives_what_the_spec_leaves_out_and_the_spec_wins() -> None:
    from_env = lake_settings(None, ENV)
    assert (from_env.s3_endpoint, from_env.region, from_env.gcs_endpoint) == (
        "http://127.0.0.1:9000", "eu-west-1", "http://127.0.0.1:4443")
    spec = lake_settings({"endpoint": "https://minio.internal", "region": "us-east-2", "timeout_seconds": 5}, ENV)
    assert (spec.s3_endpoint, spec.region, spec.timeout_seconds) == ("https://minio.internal", "us-east-2", 5.0)
    s3_specific = lake_settings(None, {**ENV, "AWS_ENDPOINT_URL_S3": "http://s3-only:9000"})
    assert s3_specific.s3_endpoint == "http://s3-only:9000"


def test_each_client_gets_the_same_settings_and_no_credential() -> None:
    settings = lake_settings(None, ENV)
    s3 = settings.obstore_kwargs("s3")
    assert s3["config"] == {"endpoint": "http://127.0.0.1:9000", "region": "eu-west-1"}
    assert s3["client_options"]["allow_http"] is True and s3["retry_config"] == {"max_retries": 0}
    gcs = settings.obstore_kwargs("gs")
    assert gcs["config"] == {"base_url": "http://127.0.0.1:4443", "skip_signature": True}
    assert pyiceberg_properties(settings) == {"s3.endpoint": "http://127.0.0.1:9000",
                                               "s3.force-virtual-addressing": "false", "s3.region": "eu-west-1",
                                               "gcs.service.host": "http://127.0.0.1:4443"}
    assert settings.duckdb_settings() == {"s3_endpoint": "127.0.0.1:9000", "s3_use_ssl": "false",
                                          "s3_url_style": "path", "s3_region": "eu-west-1"}
    for out in (s3, gcs, pyiceberg_properties(settings), settings.duckdb_settings()):
        assert "never-copied" not in repr(out)
    # AWS's own endpoint: nothing to set, and HTTPS only.
    aws = lake_settings(None, {"AWS_REGION": "eu-west-1"})
    assert aws.obstore_kwargs("s3")["config"] == {"region": "eu-west-1"}
    assert "allow_http" not in aws.obstore_kwargs("s3")["client_options"]
    assert aws.duckdb_settings() == {"s3_region": "eu-west-1"}
