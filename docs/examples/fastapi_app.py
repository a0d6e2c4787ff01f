"""A FastAPI app that saves an order and enqueues its shipping in one transaction.

The broker's store is the app's own database (here ``DATABASE_URL``, the URL that
``broker-main --database-url`` is given too). Each request gets an ``AsyncSession``
whose transaction commits when the endpoint returns and rolls back if it raises: the
job commits with the order, or neither exists. Run it with::

    DATABASE_URL=postgresql+asyncpg://app@db/shop uvicorn fastapi_app:app

``tests/integration/test_fastapi_example.py`` runs this very file.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import broker


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    number: Mapped[int] = mapped_column(primary_key=True)
    address: Mapped[str]


class NewOrder(BaseModel):
    number: int
    address: str


class Placed(BaseModel):
    number: int
    job_id: uuid.UUID


async def transaction(request: Request) -> AsyncIterator[AsyncSession]:
    """One transaction per request: committed after the endpoint returns, rolled back if
    it raises."""
    async with request.app.state.sessions() as session, session.begin():
        yield session


Transaction = Annotated[AsyncSession, Depends(transaction)]


async def place_order(order: NewOrder, session: Transaction) -> Placed:
    job = await broker.enqueue_in_async(session, "shop.tasks.ship", [order.number])
    session.add(Order(number=order.number, address=order.address))
    try:
        await session.flush()
    except sa.exc.IntegrityError:
        # Raising rolls the request's transaction back: the job goes with the order.
        raise HTTPException(409, f"order {order.number} exists already") from None
    return Placed(number=order.number, job_id=job.job.id)


def create_app(database_url: str) -> FastAPI:
    app = FastAPI()
    app.state.engine = create_async_engine(database_url)
    app.state.sessions = async_sessionmaker(app.state.engine, expire_on_commit=False)
    app.post("/orders", status_code=201)(place_order)
    return app


app = create_app(os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///shop.db"))
