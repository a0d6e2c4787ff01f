"""A per-job SQLAlchemy session, from docs/howto/hooks.md.

Run a worker with ``--app sqlalchemy_session`` and ``APP_DATABASE_URL`` set (a SQLite
URL here): each process that runs jobs opens one engine at start-up (a pool of its own),
and every job gets a fresh session, committed when the job returns and rolled back when
it raises. ``tests/e2e/test_hooks.py`` runs it with a real worker and its children.
"""

from __future__ import annotations

import contextvars
import os

from sqlalchemy import Engine, String, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from broker import JobContext, JobMiddleware, add_middleware, on_shutdown, on_startup, task


class Base(DeclarativeBase):
    pass


class Visit(Base):
    __tablename__ = "visits"
    id: Mapped[int] = mapped_column(primary_key=True)
    page: Mapped[str] = mapped_column(String(200))


# Made by the start-up hook, once per process: module globals, which that process's
# jobs read.
engine: Engine | None = None
make_session: sessionmaker[Session] | None = None


@on_startup
def open_database() -> None:
    global engine, make_session
    engine = create_engine(os.environ["APP_DATABASE_URL"])
    Base.metadata.create_all(engine)
    make_session = sessionmaker(engine)


@on_shutdown
def close_database() -> None:
    if engine is not None:
        engine.dispose()


_session: contextvars.ContextVar[Session] = contextvars.ContextVar("session")


def db() -> Session:
    """The running job's session."""
    return _session.get()


class SessionPerJob(JobMiddleware):
    # Plain methods: for a sync task they run in the task's own thread, so the session
    # set in ``before`` is the one ``db()`` returns there (and the loop never waits on
    # the database).
    def before(self, job: JobContext) -> None:
        assert make_session is not None, "open_database ran at start-up"
        _session.set(make_session())

    def after(self, job: JobContext, result: object) -> None:
        session = db()
        session.commit()  # if this raises, on_failure below rolls back and closes
        session.close()

    def on_failure(self, job: JobContext, error: BaseException) -> None:
        session = db()
        session.rollback()
        session.close()


add_middleware(SessionPerJob())


@task
def record_visit(page: str, fail: bool = False) -> int:
    db().add(Visit(page=page))
    if fail:
        raise ValueError("the visit is not kept: the session rolls back")
    db().flush()
    return db().scalar(select(func.count()).select_from(Visit)) or 0
