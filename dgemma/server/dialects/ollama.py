"""(being written)"""

from __future__ import annotations

from fastapi import FastAPI

from ..runs import Served


def add_routes(app: FastAPI, served: Served) -> None:
    """(being written)"""
