"""``broker.contrib.django`` in a real Django project against real PostgreSQL: the job
goes in the view's transaction, so a rollback leaves no job and a commit leaves one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.jobs import JobStatus
from tests.conftest import drop_schema, fresh_schema_name, require_postgres
from tests.support import FAST, running_main
from tests.tls_certs import Certificates

django = pytest.importorskip("django")


@pytest.fixture(scope="module")
def django_project() -> Iterator[str]:
    """Django configured on the test PostgreSQL, its tables and the broker's in one fresh
    schema (the search_path of Django's connections); yields that schema."""
    from django.conf import settings

    url = make_url(require_postgres())
    if settings.configured:
        pytest.skip("Django was configured by another test module of this process")
    schema = fresh_schema_name()

    async def create_store() -> None:
        store = SQLAlchemyAdapter(url.render_as_string(hide_password=False), schema=schema)
        await store.setup()
        await store.close()

    asyncio.run(create_store())
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": url.database,
                "USER": url.username,
                "PASSWORD": url.password or "",
                "HOST": url.host,
                "PORT": url.port or 5432,
                "OPTIONS": {"options": f"-c search_path={schema}"},
            }
        },
        INSTALLED_APPS=["tests.django_shop"],
        USE_TZ=True,
        BROKER={"STORE_DATABASE": "default"},
    )
    django.setup()
    from django.db import connection, connections

    from tests.django_shop.models import Order

    with connection.schema_editor() as editor:
        editor.create_model(Order)
    try:
        yield schema
    finally:
        connections.close_all()
        asyncio.run(drop_schema(schema))


def _jobs() -> list[tuple[str, str, str]]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT task, args, status FROM broker_jobs ORDER BY created_us")
        return [tuple(row) for row in cursor.fetchall()]


def test_a_committed_view_leaves_its_job_and_a_rolled_back_one_leaves_none(
    django_project: str,
) -> None:
    from tests.django_shop.models import Order
    from tests.django_shop.views import PaymentDeclined, place_order

    with pytest.raises(PaymentDeclined):
        place_order(1, declined=True)
    assert _jobs() == []
    assert not Order.objects.exists()

    job = place_order(2)
    assert job is not None and not job.duplicate
    assert _jobs() == [("shop.ship", "[2]", JobStatus.QUEUED.value)]
    assert list(Order.objects.values_list("number", flat=True)) == [2]


def test_the_same_key_in_a_later_transaction_is_a_duplicate(django_project: str) -> None:
    from django.db import transaction

    from broker.contrib.django import enqueue

    with transaction.atomic():
        first = enqueue("shop.ship", [3], idempotency_key="ship-3-again")
    with transaction.atomic():
        again = enqueue("shop.ship", [3], idempotency_key="ship-3-again")
    assert first is not None and again is not None
    assert again.duplicate and again.job.id == first.job.id


def test_large_arguments_are_offloaded_in_djangos_transaction(django_project: str) -> None:
    from django.db import transaction

    from broker.contrib.django import enqueue
    from broker.payload import DEFAULT_OFFLOAD_BYTES

    big = "z" * (DEFAULT_OFFLOAD_BYTES + 1)
    with transaction.atomic():
        made = enqueue("shop.ship", [big], idempotency_key="ship-big")
    with transaction.atomic():
        again = enqueue("shop.ship", [big], idempotency_key="ship-big")
    assert made is not None and again is not None
    assert again.duplicate and again.job.args == (big,), "the duplicate's arguments, loaded"

    async def stored() -> tuple[tuple[object, ...], int]:
        url = make_url(require_postgres()).render_as_string(hide_password=False)
        store = SQLAlchemyAdapter(url, schema=django_project)
        try:
            job = await store.get_job(made.job.id)
            assert job is not None
            return job.args, await store.count_payloads()
        finally:
            await store.close()

    assert asyncio.run(stored()) == ((big,), 1), "offloaded, once, with the job's commit"


async def test_without_the_store_in_djangos_database_the_job_goes_to_the_main_on_commit(
    django_project: str,
) -> None:
    from django.db import connections
    from django.test import override_settings

    from broker.contrib.django import close_client
    from tests.django_shop.views import PaymentDeclined, place_order

    store = MemoryAdapter()
    async with running_main(store) as main:

        def view_calls() -> tuple[object, object]:
            with override_settings(BROKER={"MAIN": f"127.0.0.1:{main.port}"}):
                try:
                    with pytest.raises(PaymentDeclined):
                        place_order(10, declined=True)
                    return place_order(11), list(_jobs())
                finally:
                    close_client()
                    connections.close_all()  # this thread's own Django connections

        returned, in_django_db = await asyncio.to_thread(view_calls)
        page = await store.list_jobs()
    assert returned is None  # sent after the commit, so no result to return
    assert [(job.task, job.args) for job in page.jobs] == [("shop.ship", (11,))]
    assert ("shop.ship", "[11]", "queued") not in in_django_db


async def test_the_on_commit_client_speaks_mutual_tls_with_the_tls_settings(
    django_project: str, tmp_path: Path
) -> None:
    from django.db import connections
    from django.test import override_settings

    from broker.contrib.django import close_client
    from tests.django_shop.views import place_order

    certs = Certificates(tmp_path)
    store = MemoryAdapter()
    settings = replace(FAST, tls=certs.server_tls(mutual=True))
    async with running_main(store, settings) as main:

        def view_call() -> None:
            tls = {
                "TLS_CA": certs.ca_path,
                "TLS_CLIENT_CERT": certs.peer.cert,
                "TLS_CLIENT_KEY": certs.peer.key,
            }
            with override_settings(BROKER={"MAIN": f"127.0.0.1:{main.port}", **tls}):
                try:
                    place_order(12)
                finally:
                    close_client()
                    connections.close_all()

        await asyncio.to_thread(view_call)
        page = await store.list_jobs()
    assert [(job.task, job.args) for job in page.jobs] == [("shop.ship", (12,))]
