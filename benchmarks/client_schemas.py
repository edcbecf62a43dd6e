"""Structured output as real clients ask for it: issue 42's matrix of Pydantic models and SDK calls, over HTTP.

Nine everyday models (nested, Optional, Enum, Literal, a list of models, a union of models, dates and UUIDs, a
recursive model, and an email, an IPv4 address and a `pattern`), each sent by seven clients against a live
`dgemma serve` of the shipped extraction model: openai's `parse()` plain and with `max_tokens=300`, a forced
strict tool made by `openai.pydantic_function_tool`, langchain-openai's `with_structured_output` in its
`json_schema` and `function_calling` methods, and instructor in its TOOLS and JSON_SCHEMA modes (where it is
installed: `pip install instructor`). A case passes when the client returns the Pydantic object (its own
parsing and validation); otherwise the table shows the first words of the error. The last column is the mean
seconds per answer (each a draft and a fill on the engine). Prints a table and ends with one JSON line.

    python benchmarks/client_schemas.py [--seeds 1] [--steps 6] [--deep]

With --deep, issue 55's models instead (DEEP_MODELS: OpenAI's recursive UI tree, a company nested six deep,
two models that refer to each other, a Decimal and a 4-digit year bound) on the shipped code model, whose
context fits them.
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import enum
import ipaddress
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Literal, Optional, Union

import openai
from pydantic import BaseModel, EmailStr, Field

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the live server (tests/live_server.py)
from live_server import KEY, LiveServer

import dgemma
from dgemma.server.app import create_app
from dgemma.tasks.code import MODEL_DIR as CODE_DIR
from dgemma.tasks.extract import MODEL_DIR


class Address(BaseModel):
    city: str
    street: str


class Nested(BaseModel):
    customer: str
    address: Address


class WithOptional(BaseModel):
    customer: str
    note: Optional[str] = None  # noqa: UP045 (as users write it)


class Colour(enum.StrEnum):
    red = "red"
    blue = "blue"
    green = "green"


class WithEnum(BaseModel):
    item: str
    colour: Colour


class WithLiteral(BaseModel):
    item: str
    shipping: Literal["express", "standard"]


class Line(BaseModel):
    item: str
    quantity: int


class ListOfModels(BaseModel):
    lines: list[Line]


class Cat(BaseModel):
    kind: Literal["cat"]
    name: str


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class WithUnion(BaseModel):
    pet: Union[Cat, Dog]  # noqa: UP007


class DatesAndIds(BaseModel):
    order_id: uuid.UUID
    placed: datetime.date
    shipped_at: datetime.datetime


class Category(BaseModel):
    name: str
    children: list[Category] = []


class Contact(BaseModel):
    email: EmailStr
    server: ipaddress.IPv4Address
    phone: str = Field(pattern=r"^\+\d{2} \d{3} \d{4}$")


MODELS = [Nested, WithOptional, WithEnum, WithLiteral, ListOfModels, WithUnion, DatesAndIds, Category, Contact]


# Issue 55: what real applications nest and type (the shipped code model's context fits their layouts)
class UIType(enum.StrEnum):
    div = "div"
    button = "button"
    header = "header"
    section = "section"
    field = "field"
    form = "form"


class Attribute(BaseModel):
    name: str
    value: str


class UI(BaseModel):  # OpenAI's cookbook UI generator: a component, its children, their attributes
    type: UIType
    label: str
    children: list[UI]
    attributes: list[Attribute]


class Geo(BaseModel):
    lat: float
    lng: float


class Place(BaseModel):
    street: str
    city: str
    geo: Geo


class Employee(BaseModel):
    name: str
    address: Place


class Team(BaseModel):
    name: str
    employees: list[Employee]


class Department(BaseModel):
    name: str
    teams: list[Team]


class Company(BaseModel):  # company -> departments -> teams -> employees -> address -> geo
    name: str
    departments: list[Department]


class Person(BaseModel):  # two models that refer to each other through Optional
    name: str
    team: Optional[Squad] = None  # noqa: UP045


class Squad(BaseModel):
    title: str
    lead: Optional[Person] = None  # noqa: UP045


class Price(BaseModel):  # Decimal: "number or string" in the schema
    item: str
    price: decimal.Decimal


class Event(BaseModel):  # a 4-digit year bound
    title: str
    year: int = Field(ge=1900, le=2100)


DEEP_MODELS = [UI, Company, Person, Price, Event]
PROMPT = "Ana Lopez from Porto ordered 2 red mugs, express."


def _parse(client, model_class, seed, steps, **extra):
    r = client.chat.completions.parse(
        model="extract", messages=[{"role": "user", "content": PROMPT}], response_format=model_class,
        seed=seed, extra_body={"max_denoising_steps": steps}, **extra,
    )  # fmt: skip
    choice = r.choices[0]
    if choice.message.parsed is None or choice.finish_reason != "stop":
        raise RuntimeError(f"finish_reason {choice.finish_reason}, parsed {choice.message.parsed!r}")
    return choice.message.parsed


def _tool(client, model_class, seed, steps):
    tool = openai.pydantic_function_tool(model_class)
    name = tool["function"]["name"]
    r = client.chat.completions.parse(
        model="extract", messages=[{"role": "user", "content": PROMPT}], tools=[tool],
        tool_choice={"type": "function", "function": {"name": name}}, seed=seed,
        extra_body={"max_denoising_steps": steps},
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls or []
    if not calls or calls[0].function.parsed_arguments is None:
        raise RuntimeError(f"no parsed call (finish_reason {r.choices[0].finish_reason})")
    return calls[0].function.parsed_arguments


def _langchain(url, model_class, seed, steps, method):
    import langchain_openai

    chat = langchain_openai.ChatOpenAI(
        model="extract", base_url=url + "/v1", api_key=KEY, extra_body={"max_denoising_steps": steps},
        max_retries=0, seed=seed,
    )  # fmt: skip
    out = chat.with_structured_output(model_class, method=method).invoke(PROMPT)
    if not isinstance(out, model_class):
        raise RuntimeError(f"got {type(out).__name__}")
    return out


def _instructor(client, model_class, seed, steps, mode):
    import instructor

    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    return patched.chat.completions.create(
        model="extract", messages=[{"role": "user", "content": PROMPT}], response_model=model_class, seed=seed,
        max_retries=0, extra_body={"max_denoising_steps": steps},
    )  # fmt: skip


CLIENTS = {
    "parse": lambda c, url, m, s, n: _parse(c, m, s, n),
    "parse max_tokens=300": lambda c, url, m, s, n: _parse(c, m, s, n, max_tokens=300),
    "pydantic_function_tool": lambda c, url, m, s, n: _tool(c, m, s, n),
    "langchain json_schema": lambda c, url, m, s, n: _langchain(url, m, s, n, "json_schema"),
    "langchain function_calling": lambda c, url, m, s, n: _langchain(url, m, s, n, "function_calling"),
    "instructor TOOLS": lambda c, url, m, s, n: _instructor(c, m, s, n, "TOOLS"),
    "instructor JSON_SCHEMA": lambda c, url, m, s, n: _instructor(c, m, s, n, "JSON_SCHEMA"),
}


def _reason(error: Exception) -> str:
    text = str(error).replace("\n", " ")
    if isinstance(error, openai.APIStatusError):
        text = (
            f"{error.status_code} " + (error.body or {}).get("message", text) if isinstance(error.body, dict) else text
        )
    return text[:70]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=1, help="seeds per case (a case passes when every seed does)")
    parser.add_argument("--steps", type=int, default=6, help="max_denoising_steps")
    parser.add_argument("--deep", action="store_true", help="issue 55's models (DEEP_MODELS) on the code model")
    args = parser.parse_args()
    models, model_dir = (DEEP_MODELS, CODE_DIR) if args.deep else (MODELS, MODEL_DIR)
    app = create_app(dgemma.load(model_dir), dgemma.Tokenizer.from_dir(model_dir), model_name="extract", api_key=KEY)
    rows, t0 = [], time.perf_counter()
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        for model_class in models:
            for name, call in CLIENTS.items():
                error, started = None, time.perf_counter()
                for seed in range(args.seeds):
                    try:
                        call(client, live.url, model_class, seed, args.steps)
                    except Exception as e:  # a failed case is a row of the table, not the end of the run
                        error = _reason(e)
                        break
                seconds = (time.perf_counter() - started) / args.seeds
                rows.append({"model": model_class.__name__, "client": name, "ok": error is None, "error": error,
                             "seconds": round(seconds, 3)})  # fmt: skip
                print(f"{model_class.__name__:>14} {name:<27} {'ok' if error is None else error}", flush=True)
    passed = sum(r["ok"] for r in rows)
    print(f"\n| model | {' | '.join(CLIENTS)} | s per answer |\n|---|{'---|' * (len(CLIENTS) + 1)}")
    for model_class in models:
        mine = [r for r in rows if r["model"] == model_class.__name__]
        cells = ["ok" if r["ok"] else "fail" for r in mine]
        print(f"| {model_class.__name__} | {' | '.join(cells)} | {sum(r['seconds'] for r in mine) / len(mine):.2f} |")
    print(f"\n{passed} of {len(rows)} cases pass ({args.seeds} seed(s) each), {time.perf_counter() - t0:.0f} s")
    print(json.dumps({"benchmark": "client_schemas", "passed": passed, "cases": len(rows), "seeds": args.seeds,
                      "failures": [r for r in rows if not r["ok"]]}))  # fmt: skip


if __name__ == "__main__":
    main()
