"""The HTTP API's OpenAPI document: the one served is the one committed (deploy/openapi.json), so that a change to
the API shows in review; it is valid OpenAPI; and every route but /healthz asks for a bearer token."""

from __future__ import annotations

import json
from pathlib import Path

from openapi_spec_validator import validate

from workers.api import openapi_document

COMMITTED = Path(__file__).parent.parent / "deploy" / "openapi.json"
REGENERATE = "astraeus api --openapi > deploy/openapi.json"


def test_the_committed_document_is_the_one_the_api_serves() -> None:
    assert json.loads(COMMITTED.read_text()) == openapi_document(), f"the API changed: {REGENERATE}"


def test_the_document_is_valid_openapi() -> None:
    validate(openapi_document())


def test_every_route_but_healthz_takes_a_bearer_token_and_says_401() -> None:
    document = openapi_document()
    assert document["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "A workspace token, or an admin token (astraeus token create)",
    }
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if path == "/healthz":
                assert "security" not in operation
                continue
            assert operation["security"] == [{"HTTPBearer": []}], (method, path)
            assert "401" in operation["responses"], (method, path)


def test_the_run_spec_is_the_body_of_post_jobs_as_json_or_yaml() -> None:
    document = openapi_document()
    body = document["paths"]["/jobs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/yaml"}
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/JobSpec"}
    assert "groups" in document["components"]["schemas"]["JobSpec"]["properties"]
    # the spec's own definitions resolve among the document's schemas
    text = json.dumps(document)
    refs = {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}
    assert refs <= set(document["components"]["schemas"])


def test_the_spec_path_form_of_a_stop_is_served_beside_the_jobs_one() -> None:
    paths = openapi_document()["paths"]
    assert "post" in paths["/tasks/{full}/stop"]
    assert "post" in paths["/jobs/{ns}/{name}/tasks/{task}/stop"]
