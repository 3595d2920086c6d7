# lowprec dump: Sequential_0, forward graph as captured
# GraphModule.code of the FX graph. Run: GraphModule().forward(*inputs), the inputs as
# manifest.json lists them under graphs["forward"]["inputs"].
import torch
from torch import device  # noqa: F401
from math import inf, nan  # noqa: F401
import lpcompile  # noqa: F401  (defines the torch.ops.lowprec operators)


class GraphModule(torch.nn.Module):
    def forward(self, primals_1, primals_2, primals_3, primals_4, primals_5, primals_6):
        quantize = torch.ops.lowprec.quantize.default(primals_3, 'e5m2', 'nearest', 'saturate', None, 1382219776, None);  primals_3 = None
        quantize_grad = torch.ops.lowprec.quantize_grad.default(primals_1, 'e5m2', 'stochastic', 'inf', primals_6, 1382219777);  primals_1 = None
        quantize_1 = torch.ops.lowprec.quantize.default(quantize_grad, 'e5m2', 'nearest', 'saturate', None, 1382219778, None);  quantize_grad = None
        t = torch.ops.aten.t.default(quantize_1);  quantize_1 = None
        addmm = torch.ops.aten.addmm.default(primals_2, quantize, t);  primals_2 = t = None
        quantize_grad_1 = torch.ops.lowprec.quantize_grad.default(addmm, 'e5m2', 'stochastic', 'inf', primals_6, 1382219779);  addmm = None
        relu = torch.ops.aten.relu.default(quantize_grad_1);  quantize_grad_1 = None
        detach = torch.ops.aten.detach.default(relu)
        quantize_2 = torch.ops.lowprec.quantize.default(relu, 'e5m2', 'nearest', 'saturate', None, 1382219780, None);  relu = None
        quantize_grad_2 = torch.ops.lowprec.quantize_grad.default(primals_4, 'e5m2', 'stochastic', 'inf', primals_6, 1382219781);  primals_4 = None
        quantize_3 = torch.ops.lowprec.quantize.default(quantize_grad_2, 'e5m2', 'nearest', 'saturate', None, 1382219782, None);  quantize_grad_2 = None
        t_1 = torch.ops.aten.t.default(quantize_3);  quantize_3 = None
        addmm_1 = torch.ops.aten.addmm.default(primals_5, quantize_2, t_1);  primals_5 = None
        quantize_grad_3 = torch.ops.lowprec.quantize_grad.default(addmm_1, 'e5m2', 'stochastic', 'inf', primals_6, 1382219783);  addmm_1 = None
        return (quantize_grad_3, primals_6, quantize, detach, quantize_2, t_1)
