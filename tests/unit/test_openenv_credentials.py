"""Bearer token rules, transport rule, env-var names, reflection and redaction (§7, §11)."""

import pytest

from kiln.core.errors import InvalidCredential
from kiln.core.openenv.credentials import (
    bearer_headers,
    contains_token,
    parse_credential_env_args,
    prepare_token,
    read_token_from_env,
    redact,
    validate_bearer_token,
)
from kiln.core.openenv.urls import normalize_url


@pytest.mark.parametrize("token", [" \t", "abc\ndef", " leading", "trailing ", "in ternal", "", "a\x01b", "\u00a0x"])
def test_bad_tokens_rejected_without_echo(token):
    with pytest.raises(InvalidCredential) as info:
        validate_bearer_token(token)
    assert info.value.code == "openenv_invalid_credential"
    if token.strip():
        assert token.strip() not in info.value.message


def test_good_token_and_header():
    assert validate_bearer_token("tok_123.ABC-xyz") == "tok_123.ABC-xyz"
    assert bearer_headers("tok") == {"Authorization": "Bearer tok"}
    assert bearer_headers(None) == {}


def test_bearer_over_http_only_on_loopback():
    with pytest.raises(InvalidCredential):
        prepare_token(normalize_url("http://example.test:8000"), "tok")
    assert prepare_token(normalize_url("http://[::1]:8990"), "tok") == "tok"
    assert prepare_token(normalize_url("https://example.test"), "tok") == "tok"
    assert prepare_token(normalize_url("http://example.test"), None) is None


def test_env_var_names_and_slots():
    assert read_token_from_env("KILN_TOK", {"KILN_TOK": "abc"}) == "abc"
    for name in ("1BAD", "has-dash", "x" * 129, ""):
        with pytest.raises(InvalidCredential) as info:
            read_token_from_env(name, {name: "abc"})
        assert name not in info.value.message or name == ""
    with pytest.raises(InvalidCredential):
        read_token_from_env("UNSET_VAR", {})
    assert parse_credential_env_args(["A", "-"], 2) == ["A", None]
    assert parse_credential_env_args([], 3) == [None, None, None]
    with pytest.raises(InvalidCredential):
        parse_credential_env_args(["A"], 2)


def test_reflection_and_redaction():
    assert contains_token(b'{"x":"Bearer s3cret"}', "s3cret")
    assert not contains_token("nothing here", "s3cret")
    assert not contains_token("s3cret", None)
    assert redact("got s3cret twice s3cret", "s3cret") == "got [redacted] twice [redacted]"
