"""Secrets in an endpoint URL are blanked wherever a run stores it, and a resume gets them back only from the user."""

from __future__ import annotations

import json

import pytest

from sg_opt.redact import public_url, redact_url, resolve_base_url
from sg_opt.run_store import RunRequest
from targets.protocol import ConfigError


@pytest.mark.parametrize("url, stored", [
    ("http://localhost:8000/v1", "http://localhost:8000/v1"),
    ("https://user:p4ss@gw.example.com/v1", "https://***@gw.example.com/v1"),
    ("https://t0ken@gw.example.com/v1", "https://***@gw.example.com/v1"),
    ("https://x.openai.azure.com/openai?api-version=2024-06-01&api-key=abc123",
     "https://x.openai.azure.com/openai?api-version=2024-06-01&api-key=***"),
    ("https://gw.example.com/v1?access_token=abc&sig=def", "https://gw.example.com/v1?access_token=***&sig=***"),
    (None, None),
], ids=["plain", "user-password", "token-as-user", "azure-key", "token-and-signature", "none"])
def test_credentials_and_secret_query_values_are_blanked_the_rest_kept(url, stored):
    assert redact_url(url) == stored


def test_a_run_request_never_writes_the_secret(tmp_path):
    request = RunRequest(run_id="r", target="t", size="s", base_url="https://user:p4ss@gw.example.com/v1?key=k3y")
    written = request.model_dump_json()
    assert "p4ss" not in written and "k3y" not in written
    assert json.loads(written)["base_url"] == "https://***@gw.example.com/v1?key=***"
    assert request.base_url.startswith("https://user:p4ss@")  # the run itself still has it
    assert public_url(request.base_url) == "https://gw.example.com/v1"


def test_a_resume_takes_the_endpoint_from_the_user_or_says_in_a_sentence_what_to_pass(monkeypatch):
    secret = "https://user:p4ss@gw.example.com/v1"
    stored = redact_url(secret)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert resolve_base_url("http://localhost:8000/v1") == "http://localhost:8000/v1"
    assert resolve_base_url(stored, secret) == secret
    with pytest.raises(ConfigError, match=r"^this run's --base-url https://\*\*\*@gw.example.com/v1 held "
                                          r"credentials, which are not stored: pass the same --base-url"):
        resolve_base_url(stored, "https://other:creds@gw.example.com/v1".replace("gw", "elsewhere"))
    monkeypatch.setenv("OPENAI_BASE_URL", secret)
    assert resolve_base_url(stored) == secret
