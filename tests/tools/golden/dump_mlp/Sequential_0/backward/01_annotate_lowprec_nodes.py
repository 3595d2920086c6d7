# lowprec dump: Sequential_0, backward graph after pass 1 of 1: annotate_lowprec_nodes
# GraphModule.code of the FX graph. Run: GraphModule().forward(*inputs), the inputs as
# manifest.json lists them under graphs["backward"]["inputs"].
import torch
from torch import device  # noqa: F401
from math import inf, nan  # noqa: F401
import lpcompile  # noqa: F401  (defines the torch.ops.lowprec operators)


class GraphModule(torch.nn.Module):
    def forward(self, primals_6, quantize, detach, quantize_2, t_1, tangents_1):
        quantize_4 = torch.ops.lowprec.quantize.default(tangents_1, 'e5m2', 'stochastic', 'inf', primals_6, 1382219783, None);  tangents_1 = None
        t_2 = torch.ops.aten.t.default(t_1);  t_1 = None
        mm = torch.ops.aten.mm.default(quantize_4, t_2);  t_2 = None
        t_3 = torch.ops.aten.t.default(quantize_4)
        mm_1 = torch.ops.aten.mm.default(t_3, quantize_2);  t_3 = quantize_2 = None
        t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
        sum_1 = torch.ops.aten.sum.dim_IntList(quantize_4, [0], True);  quantize_4 = None
        view = torch.ops.aten.view.default(sum_1, [3]);  sum_1 = None
        t_5 = torch.ops.aten.t.default(t_4);  t_4 = None
        quantize_5 = torch.ops.lowprec.quantize.default(t_5, 'e5m2', 'stochastic', 'inf', primals_6, 1382219781, None);  t_5 = None
        detach_1 = torch.ops.aten.detach.default(detach);  detach = None
        threshold_backward = torch.ops.aten.threshold_backward.default(mm, detach_1, 0);  mm = detach_1 = None
        quantize_6 = torch.ops.lowprec.quantize.default(threshold_backward, 'e5m2', 'stochastic', 'inf', primals_6, 1382219779, None);  threshold_backward = None
        t_6 = torch.ops.aten.t.default(quantize_6)
        mm_2 = torch.ops.aten.mm.default(t_6, quantize);  t_6 = quantize = None
        t_7 = torch.ops.aten.t.default(mm_2);  mm_2 = None
        sum_2 = torch.ops.aten.sum.dim_IntList(quantize_6, [0], True);  quantize_6 = None
        view_1 = torch.ops.aten.view.default(sum_2, [8]);  sum_2 = None
        t_8 = torch.ops.aten.t.default(t_7);  t_7 = None
        quantize_7 = torch.ops.lowprec.quantize.default(t_8, 'e5m2', 'stochastic', 'inf', primals_6, 1382219777, None);  t_8 = primals_6 = None
        return (quantize_7, view_1, None, quantize_5, view, None)
