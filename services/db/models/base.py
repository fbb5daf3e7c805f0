"""The declarative base every table maps on (constraint naming, column types), and the
column helpers the tables share: keys, references, creation times, sha256 digests."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Double,
    Enum,
    ForeignKey,
    Identity,
    Integer,
    MetaData,
    String,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, MappedColumn, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
"""Constraint names are derived from the columns, so migrations can name what they alter."""

SHA256_HEX_LEN = 64


def pg_enum(cls: type[StrEnum], name: str) -> Enum:
    """A PostgreSQL enum type holding the members' values (lowercase), not their names."""
    return Enum(cls, name=name, values_callable=lambda e: [m.value for m in e], validate_strings=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        dict[str, Any]: JSONB,
        list[Any]: JSONB,
        datetime: DateTime(timezone=True),
        int: Integer,
        float: Double,
        str: Text,
    }


def primary_key() -> MappedColumn[Any]:
    return mapped_column(BigInteger, Identity(), primary_key=True)


def foreign_key(target: str, *, ondelete: str | None = None, nullable: bool = False) -> MappedColumn[Any]:
    return mapped_column(BigInteger, ForeignKey(target, ondelete=ondelete), nullable=nullable)


def created_time() -> MappedColumn[Any]:
    return mapped_column(server_default=func.now())


def sha256_hex(*, nullable: bool = False) -> MappedColumn[Any]:
    return mapped_column(String(SHA256_HEX_LEN), nullable=nullable)
