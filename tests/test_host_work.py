"""lockstep.tools.host_work counts what a step asks of the host: reads of tensor data and aten ops."""

import threading

import pytest
import torch

from lockstep.tools.host_work import READS, HostWork


def test_each_read_of_tensor_data_is_counted_by_its_method():
    t, s = torch.arange(6.0).reshape(2, 3), torch.tensor(2)
    with HostWork() as work:
        t.tolist()
        t[0, 1].item()
        bool(s > 1)
        int(s)
        float(s)
        [10, 20, 30][s]
        t.numpy()
        t.cpu()
        if s:
            pass
    assert work.reads == {"tolist": 1, "item": 1, "bool": 2, "int": 1, "float": 1, "index": 1, "numpy": 1, "cpu": 1}
    assert work.total_reads == 9
    assert set(work.reads) == set(READS.values())


def test_ops_that_compute_are_counted_and_views_and_reads_are_not():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with HostWork() as work:
        y = x @ w.T                       # w.T is a view, the product one op
        y = y.view(2, 6)[:, 1:]           # views
        z = torch.empty(5)                # an allocation
        z.fill_(1.0)
        y.sum().item()                    # the sum is an op, item() a read
    assert work.ops["aten.mm"] == 1 and work.ops["aten.fill_"] == 1 and work.ops["aten.sum"] == 1
    assert not [op for op in work.ops if op in ("aten.view", "aten.t", "aten.slice", "aten._local_scalar_dense")]
    assert work.allocations["aten.empty"] >= 1 and "aten.empty" not in work.ops
    assert work.reads == {"item": 1}


def test_the_methods_are_restored_and_other_threads_are_not_counted():
    s = torch.tensor(1)
    with HostWork() as work:
        other = threading.Thread(target=lambda: [bool(s) for _ in range(5)])
        other.start()
        other.join()
    bool(s)
    assert work.total_reads == 0
    assert "__bool__" not in torch.Tensor.__dict__ and "item" not in torch.Tensor.__dict__
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist


def test_one_block_at_a_time():
    with HostWork():
        with pytest.raises(RuntimeError, match="^HostWork: another block is counting in this process; one at a time$"):
            with HostWork():
                pass
    with HostWork() as work:            # the first block's end frees the next
        torch.tensor(1).item()
    assert work.reads == {"item": 1}
