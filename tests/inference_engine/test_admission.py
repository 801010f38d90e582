import asyncio

import pytest

from inference_engine.admission import FifoSlots


def test_slots_are_granted_in_arrival_order():
    async def scenario() -> list[int]:
        slots = FifoSlots(1)
        order: list[int] = []
        await slots.acquire()

        async def worker(i: int) -> None:
            await slots.acquire()
            order.append(i)
            await asyncio.sleep(0)
            slots.release()

        tasks = [asyncio.create_task(worker(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        slots.release()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]


def test_a_cancelled_waiter_does_not_leak_its_slot():
    async def scenario() -> int:
        slots = FifoSlots(1)
        await slots.acquire()
        waiter = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        slots.release()
        await asyncio.wait_for(slots.acquire(), 1)
        return slots.waiting

    assert asyncio.run(scenario()) == 0


def test_at_most_n_holders_at_once():
    async def scenario() -> int:
        slots = FifoSlots(2)
        active, peak = 0, 0

        async def worker() -> None:
            nonlocal active, peak
            await slots.acquire()
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.005)
            active -= 1
            slots.release()

        await asyncio.gather(*(worker() for _ in range(8)))
        return peak

    assert asyncio.run(scenario()) == 2
