"""Admission to the handshake (broker.core.admission): the limits always hold, a slot
freed goes to the first connection in line that fits, nobody waits while a slot it fits
is free (one address at its limit holds up no other), and a withdrawn ticket holds
nothing."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from broker.core.admission import Admission
from tests.unit.conftest import PROFILE

ADDRESSES = ["a", "b", "c"]
TOTAL, PER_ADDRESS = 3, 2


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.admission: Admission[int] = Admission(TOTAL, PER_ADDRESS)
        self.holding: list[tuple[int, str]] = []
        self.line: list[tuple[int, str]] = []
        self.next = 0

    @rule(address=st.sampled_from(ADDRESSES))
    def enter(self, address: str) -> None:
        self.next += 1
        fits = self.admission.blocked(address) is None
        if self.admission.enter(address, self.next):
            assert fits
            self.holding.append((self.next, address))
        else:
            self.line.append((self.next, address))

    @precondition(lambda self: bool(self.holding))
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        ticket, address = data.draw(st.sampled_from(self.holding))
        self.holding.remove((ticket, address))
        admitted = self.admission.leave(address)
        expected = []
        for waiting in list(self.line):  # the model: first in line that fits, in order
            if len(self.holding) >= TOTAL:
                break
            if sum(1 for _, a in self.holding if a == waiting[1]) < PER_ADDRESS:
                self.line.remove(waiting)
                self.holding.append(waiting)
                expected.append(waiting[0])
        assert admitted == expected

    @precondition(lambda self: bool(self.line))
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        waiting = data.draw(st.sampled_from(self.line))
        assert self.admission.withdraw(waiting[0])
        self.line.remove(waiting)
        assert not self.admission.withdraw(waiting[0])

    @invariant()
    def limits_hold(self) -> None:
        assert len(self.holding) <= TOTAL
        for address in ADDRESSES:
            held = sum(1 for _, a in self.holding if a == address)
            assert held <= PER_ADDRESS and self.admission.held[address] == held
        assert self.admission.waiting == len(self.line)

    @invariant()
    def nobody_waits_for_a_free_slot_it_fits(self) -> None:
        for _, address in self.line:
            assert self.admission.blocked(address) is not None


TestAdmission = AdmissionMachine.TestCase
TestAdmission.settings = settings(settings.get_profile(PROFILE), stateful_step_count=40)


def test_the_refusal_names_the_limit_and_its_flag() -> None:
    admission: Admission[int] = Admission(total=2, per_address=1)
    assert admission.enter("a", 1)
    assert admission.blocked("a") == (
        "1 handshakes are under way from a, the limit per address "
        "(--max-unauthenticated-per-address)"
    )
    assert admission.enter("b", 2)
    assert admission.blocked("c") == (
        "2 connections are in the handshake, the limit (--max-unauthenticated)"
    )
