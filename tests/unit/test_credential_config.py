"""Credential ids resolve through KILN_CREDENTIALS: exact-origin binding, no secret in errors."""

from __future__ import annotations

import pytest

from kiln.core.errors import InvalidCredential
from kiln.core.openenv.credential_config import check_credential, resolve_bearer_token

CONFIG = {
    "hub": {"origin": "https://env.example.test", "bearer_token_env": "KILN_TEST_HUB_TOKEN"},
    "local": {"origin": "http://127.0.0.1:8990", "bearer_token_env": "KILN_TEST_LOCAL_TOKEN"},
}
SECRET = "s3cr3t-token-value"


def test_public_slot_resolves_to_none() -> None:
    assert resolve_bearer_token(CONFIG, None, "http://127.0.0.1:8990") is None


def test_token_resolves_for_its_exact_origin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_TEST_LOCAL_TOKEN", SECRET)
    assert resolve_bearer_token(CONFIG, "local", "127.0.0.1:8990/") == SECRET


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8991", "https://127.0.0.1:8990", "http://localhost:8990"],
)
def test_other_origins_are_refused_without_reading_the_secret(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("KILN_TEST_LOCAL_TOKEN", SECRET)
    with pytest.raises(InvalidCredential) as error:
        resolve_bearer_token(CONFIG, "local", url)
    assert error.value.code == "openenv_invalid_credential"
    assert "not authorized for origin" in error.value.message
    assert SECRET not in str(error.value.to_dict()) and "KILN_TEST_LOCAL_TOKEN" not in str(error.value.to_dict())


def test_unknown_id_and_missing_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidCredential, match="not configured"):
        check_credential(CONFIG, "nope", "https://env.example.test")
    monkeypatch.delenv("KILN_TEST_HUB_TOKEN", raising=False)
    with pytest.raises(InvalidCredential) as error:
        resolve_bearer_token(CONFIG, "hub", "https://env.example.test")
    assert "KILN_TEST_HUB_TOKEN" not in error.value.message


def test_token_with_whitespace_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_TEST_HUB_TOKEN", "bad token")
    with pytest.raises(InvalidCredential, match="whitespace"):
        resolve_bearer_token(CONFIG, "hub", "https://env.example.test")
