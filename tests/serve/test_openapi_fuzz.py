"""Property-based fuzzing from the service's own OpenAPI document (schemathesis): valid and invalid requests for
every operation, sent with a valid key (an admin key of the served collection: every endpoint is open to it); no
5xx, and every response's status, content type and JSON body are the ones documented."""

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from serve.app import create_app
from serve.auth import FileKeys, new_key
from tests.serve.test_app import LIMITS

OPERATIONS = [("POST", "/search"), ("POST", "/search/image"), ("GET", "/images/{raw_id}"), ("GET", "/explain"),
              ("GET", "/health"), ("GET", "/metrics"), ("GET", "/")]
WITH_CONSTRAINTS = {"/search", "/search/image", "/explain"}  # operations whose inputs can violate the schema
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_EXAMPLES = 300  # per operation and mode: the whole file stays under a minute on one thread
SENT = {"requests": 0, "seconds": 0.0}
KEY = {}  # "headers": the fuzzer's Authorization header


@pytest.fixture(scope="module")
def api_schema(serve_env, tmp_path_factory):
    from schemathesis.python.asgi import shutdown_lifespans

    keys = FileKeys(tmp_path_factory.mktemp("fuzzkeys") / "keys.json", create=True)
    token, record = new_key("default", "admin", name="fuzzer", rate=0)  # no rate limit: thousands of requests
    keys.add(record)
    KEY["headers"] = {"Authorization": f"Bearer {token}"}
    yield schemathesis.openapi.from_asgi("/openapi.json", create_app(serve_env.idx, limits=LIMITS, keys=keys))
    shutdown_lifespans()  # stops the app's micro-batcher, started on the first request
    print(f"\nfuzz: {SENT['requests']} requests in {SENT['seconds']:.1f} s")


def test_every_operation_is_fuzzed(api_schema):
    documented = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


@pytest.mark.parametrize("method,path,mode", [
    *((m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS),
    *((m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if p in WITH_CONSTRAINTS)])  # others: nothing to break
def test_responses_match_the_document(api_schema, method, path, mode):
    operation = api_schema[path][method]
    # negative data (outside the schema: k = 0, text over the limit, ...) must also be refused with a 4xx
    checks = CHECKS + [negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        start = time.perf_counter()
        case.call_and_validate(checks=checks, headers=KEY["headers"])
        SENT["requests"] += 1
        SENT["seconds"] += time.perf_counter() - start

    fuzz()


def test_document_states_the_limits(api_schema):
    doc = api_schema.raw_schema
    body = doc["components"]["schemas"]["SearchRequest"]["properties"]
    assert body["text"]["maxLength"] == LIMITS.max_text_chars and body["text"]["minLength"] == 1
    assert body["k"]["minimum"] == 1 and body["k"]["maximum"] == LIMITS.max_k
    upload = doc["paths"]["/search/image"]["post"]
    assert str(LIMITS.max_upload_bytes) in upload["description"] and "413" in upload["responses"]
    image = doc["paths"]["/images/{raw_id}"]["get"]["responses"]
    assert set(image) == {"200", "400", "401", "403", "404", "413", "429", "500", "503"}
    assert "image/*" in image["200"]["content"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert doc["paths"]["/explain"]["get"]["responses"]["500"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/InternalErrorBody"}


def test_document_declares_the_keys(api_schema):
    doc = api_schema.raw_schema
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "an API key: python -m serve keys create"}
    for method, path in OPERATIONS:
        op = doc["paths"][path][method.lower()]
        if path in ("/", "/health"):
            assert op["security"] == ([] if path == "/" else [{}, {"bearer": []}])
            continue
        assert op["security"] == [{"bearer": []}], path
        assert {"401", "403", "429"} <= set(op["responses"]), path
        assert "Retry-After" in op["responses"]["429"]["headers"]
        assert {"name": "X-Collection", "in": "header"}.items() <= op["parameters"][-1].items()
    r = schemathesis_client(api_schema).post("/search", json={"text": "a red circle"})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")


def schemathesis_client(api_schema):
    from fastapi.testclient import TestClient

    return TestClient(api_schema.app)


@pytest.mark.parametrize("body,message", [
    ({"text": "a red circle", "k": "5"}, "k: Input should be a valid integer"),
    ({"text": "a red circle", "k": 5.0}, "k: Input should be a valid integer"),
    ({"text": "a red circle", "rerank": 0}, "rerank: Input should be a valid boolean"),
    ({"text": "a red circle", "rerank": "true"}, "rerank: Input should be a valid boolean"),
])
def test_json_body_types_are_the_documented_ones(api_schema, body, message):
    from fastapi.testclient import TestClient

    r = TestClient(api_schema.app).post("/search", json=body,  # refused before the (unstarted) micro-batcher
                                        headers=KEY["headers"])
    assert r.status_code == 422 and message in r.json()["error"], r.text
