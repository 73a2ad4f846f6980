"""20 varied JSON schemas (nested objects, arrays, enums, bounded numbers, required/optional fields) for
tests and `pagedllm bench structured`. Strings and arrays are bounded so a sample always fits in
`max_tokens`; `max_tokens_for` gives a budget that does. Also a contact-extraction workload whose answers
copy their prompt (`extraction_requests`)."""
from __future__ import annotations

from typing import Any

S = lambda n: {"type": "string", "maxLength": n}  # noqa: E731

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S(12), "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                      "shade": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S(8), "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "currency": {"enum": ["USD", "EUR", "JPY"]}}, "required": ["price", "currency"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "email": S(20)}, "required": ["id"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "object", "properties": {"title": S(16), "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "rating": {"type": "number", "minimum": 0, "maximum": 5}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"steps": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 9}, "do": S(10)}, "required": ["n", "do"]}}},
     "required": ["steps"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "unsure"]},
                                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"city": S(15), "country": S(15), "population": {"type": "integer",
                                                                                    "minimum": 0, "maximum": 40000000}},
     "required": ["city", "country"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "minItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"type": "integer", "minimum": 200,
                                                                            "maximum": 599}},
     "required": ["status", "code"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"nickname": S(10), "level": {"type": "integer", "minimum": 1, "maximum": 60}},
     "required": ["level"]},
    {"type": "object", "properties": {"temps": {"type": "array", "maxItems": 4, "items": {
        "type": "number", "minimum": -40, "maximum": 50}}, "unit": {"enum": ["C", "F"]}}, "required": ["temps", "unit"]},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": S(10), "legs": {
        "type": "integer", "minimum": 0, "maximum": 4}}, "required": ["kind", "name", "legs"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
        "sku": S(6), "qty": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["sku", "qty"]}},
        "total": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["items"]},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180},
                                      "label": S(12)}, "required": ["lat", "lon"]},
]


def max_tokens_for(schema: dict[str, Any]) -> int:
    """A token budget that fits any output of these schemas (numbers may carry up to ~20 digits)."""
    import json

    return 40 + 3 * len(json.dumps(schema))


#: Contact extraction (`extraction_requests`): the answer copies strings from its prompt, as document-to-JSON
#: extraction does; the workload of speculative decoding under a grammar.
CONTACT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "address": {"type": "string"}, "email": {"type": "string"},
                   "phone": {"type": "string"}},
    "required": ["name", "address", "email", "phone"], "additionalProperties": False}
_FIRST = ["John", "Aiko", "Omar", "Maria", "Lena", "Ravi", "Chen", "Fatima", "Pedro", "Olga", "Kwame", "Ines",
          "Tomas", "Yuki", "Amara", "Noah", "Sofia", "Arjun", "Elif", "Mateo"]
_LAST = ["Smith", "Tanaka", "Haddad", "Gonzalez", "Novak", "Patel", "Wei", "Rahman", "Silva", "Petrova", "Mensah",
         "Moreau", "Berg", "Sato", "Okafor", "Keller", "Rossi", "Iyer", "Demir", "Castro"]
_STREETS = ["Oak Avenue", "Cherry Lane", "Mill Road", "Harbor Street", "Elm Court", "Station Road", "Maple Drive",
            "River Walk", "Hill Crescent", "Market Square"]
_CITIES = ["Riverton", "Westfield", "Eastbrook", "Springfield", "Lakeside", "Northgate", "Brookhaven", "Fairview"]
_DOMAINS = ["example.com", "example.org", "example.net", "mail.example.com"]
_EXAMPLE = ('Text: Maria Gonzalez lives at 42 Harbor Street, Springfield. Her email is maria.gonzalez@example.com '
            'and her phone is 555-0142.\nJSON: {"name": "Maria Gonzalez", "address": "42 Harbor Street, Springfield", '
            '"email": "maria.gonzalez@example.com", "phone": "555-0142"}\n')


def extraction_requests(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts (deterministic for a seed), each one worked example and a new contact to extract as JSON
    matching CONTACT_SCHEMA; the answers are ~35-45 tokens with the bundled tokenizer."""
    import random

    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        address = f"{rng.randint(1, 250)} {rng.choice(_STREETS)}, {rng.choice(_CITIES)}"
        email = f"{first.lower()}.{last.lower()}@{rng.choice(_DOMAINS)}"
        phone = f"555-{rng.randint(100, 9999):04d}"
        prompts.append(_EXAMPLE + f"Text: {first} {last} lives at {address}. The email is {email} and the phone "
                       f"is {phone}.\nJSON:")
    return prompts
