// The bridge's native lane: a repeat of the last call the bridge launched itself, checked and launched in C++.
//
// bridge/native/__init__.py builds this file with torch's extension builder and bridge/direct.py arms
// one Lane per module after a call it launched itself: the Mosaic GPU kernel (bridge/mosaic_launch.py)
// or a program of Triton kernels (bridge/triton_launch.py). A Lane holds what that call was: x's sizes
// and device, how the mask was used, the parameters' data pointers and versions, the kernel's weight
// tensors, and how to launch: jax's compiled host entry with the arguments it takes besides the
// kernel's pointers (forms 3 and 1), or the CUDA driver's cuLaunchKernel with each kernel's function,
// grid, block, shared memory and parameters (form 4, a workspace allocated per call). `run(x, mask)`
// returns the new output when this call is the same call on unchanged inputs, and None otherwise: the
// Python path then runs, decides again and re-arms. Every check the Python path makes for a launched
// call is made here or by the caller (bridge/runtime.py, fast_forward); none is skipped.
//
// Only ATen, c10 and pybind11 headers: the file builds against a CPU-only torch as well, where a Lane
// on CPU tensors (no stream, no device guard) runs the tests with a stand-in entry.

#include <torch/csrc/utils/pybind.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/where.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <optional>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

namespace {

// How the armed call used the mask (bridge/direct.py, lane_mask_mode).
enum MaskMode : int {
  kNoMask = 0,     // called with no mask
  kKeptMask = 1,   // a GPU mask classified on the host, kept per tensor and version: the mask-free kernel
  kDeviceMask = 2, // the kernel's masked build reads any mask (TTJ_GPU_MASK=device)
  kInferenceMask = 3,  // the masked build for inference-tensor masks (no version counter to keep a kind by)
  kKeptMaskRows = 4,   // a kept prefix mask under causal attention: the mask-free kernel, invalid rows zeroed after
  kKeptMaskPassed = 5, // a kept mask the launch reads (the masked build, or a Triton program that takes a mask)
};

// What the kernels assume of every pointer they are handed (bridge/direct.py, KERNEL_POINTER_ALIGN): Pallas's
// Triton lowering declares each one 32-byte divisible, and the Mosaic kernel's TMA copies need 16. A view
// into another tensor may sit anywhere: the Python path copies it.
constexpr uintptr_t kPointerAlign = 32;
bool aligned(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % kPointerAlign == 0; }

bool passes_mask(int mode) { return mode == kDeviceMask || mode == kInferenceMask || mode == kKeptMaskPassed; }
bool keeps_mask(int mode) { return mode == kKeptMask || mode == kKeptMaskRows || mode == kKeptMaskPassed; }

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// One kernel of form 4: (CUfunction, grid x, y, z, block x, dynamic shared bytes, per parameter the slot
// of its array in `refs`, or -1 for a null pointer).
using KernelLaunch = std::tuple<uint64_t, unsigned, unsigned, unsigned, unsigned, unsigned, std::vector<int64_t>>;

class Lane {
 public:
  Lane(std::vector<int64_t> sizes, at::ScalarType dtype, std::vector<at::Tensor> params, std::vector<at::Tensor> weights,
       int mask_mode, std::optional<at::Tensor> kept_mask, uint64_t entry, int form,
       std::vector<uint64_t> entry_args, int64_t num_buffers, py::object keep_alive,
       std::vector<KernelLaunch> kernels, std::vector<std::pair<int64_t, int64_t>> refs, int64_t workspace_bytes,
       std::optional<at::ScalarType> kernel_dtype)
      : sizes_(std::move(sizes)),
        dtype_(dtype),
        kernel_dtype_(kernel_dtype.value_or(at::kFloat)),
        params_(std::move(params)),
        weights_(std::move(weights)),
        mask_mode_(mask_mode),
        entry_(entry),
        form_(form),
        entry_args_(std::move(entry_args)),
        buffers_(num_buffers > 0 ? num_buffers : 0, nullptr),
        keep_alive_(std::move(keep_alive)) {
    if (sizes_.size() != 3) throw std::invalid_argument("x's sizes: [batch, seq_len, d_model]");
    if (params_.empty()) throw std::invalid_argument("no parameters");
    if (mask_mode_ < kNoMask || mask_mode_ > kKeptMaskPassed) throw std::invalid_argument("unknown mask mode");
    if (form_ == 4) {
      if (!entry_args_.empty()) throw std::invalid_argument("form 4 takes no entry arguments");
    } else if ((form_ != 3 && form_ != 1) || entry_args_.size() != 2) {
      throw std::invalid_argument("entry forms: 3 (function, stream), 1 (context pointer, stream pointer), 4 (kernels)");
    }
    buffers_pointer_ = buffers_.data();
    if (form_ != 4)
      form1_args_ = {reinterpret_cast<void*>(entry_args_[0]), reinterpret_cast<void*>(entry_args_[1]),
                     static_cast<void*>(&buffers_pointer_)};
    const int64_t expected = 2 + static_cast<int64_t>(weights_.size()) +
                             (passes_mask(mask_mode_) ? 1 : 0) + (form_ == 4 ? 1 : 0);
    if (num_buffers != expected) throw std::invalid_argument("the buffer count does not fit the call");
    if (form_ == 4) set_kernels(std::move(kernels), std::move(refs), workspace_bytes);
    else if (!kernels.empty() || !refs.empty()) throw std::invalid_argument("kernels are form 4's");
    device_ = params_[0].device();
    for (const auto& p : params_) {
      if (p.is_inference()) throw std::invalid_argument("an inference-tensor parameter has no version counter");
      pointers_.push_back(p.data_ptr());
      versions_.push_back(p._version());
    }
    if (keeps_mask(mask_mode_)) {
      if (!kept_mask.has_value() || kept_mask->is_inference())
        throw std::invalid_argument("a kept mask needs the mask tensor (not an inference tensor)");
      kept_mask_.emplace(kept_mask->getIntrusivePtr());
      kept_version_ = kept_mask->_version();
      kept_sizes_ = kept_mask->sizes().vec();
      kept_dtype_ = kept_mask->scalar_type();
    }
  }

  Lane(const Lane&) = delete;  // form1_args_ points into this object
  Lane& operator=(const Lane&) = delete;

  // The output of this call, or None where it is not the armed call on unchanged inputs.
  py::object run(const at::Tensor& x, const std::optional<at::Tensor>& mask) {
    if (!x.defined() || x.device() != device_ || x.scalar_type() != dtype_ || x.sizes() != at::IntArrayRef(sizes_) ||
        !x.is_contiguous() || !aligned(x.const_data_ptr()))
      return py::none();
    if (c10::GradMode::is_enabled()) {  // a call that records for autograd takes the Python path
      if (x.requires_grad()) return py::none();
      for (const auto& p : params_)
        if (p.requires_grad()) return py::none();
    }
    const void* mask_pointer = nullptr;
    switch (mask_mode_) {
      case kNoMask:
        if (mask.has_value()) return py::none();
        break;
      case kKeptMask:
      case kKeptMaskRows:
      case kKeptMaskPassed: {
        if (!mask.has_value() || kept_mask_->expired() || mask->unsafeGetTensorImpl() != kept_mask_->_unsafe_get_target() ||
            mask->is_inference() || mask->_version() != kept_version_ || mask->device() != device_ ||
            mask->sizes() != kept_sizes_ || mask->scalar_type() != kept_dtype_)
          return py::none();
        if (mask_mode_ != kKeptMaskPassed) break;
        [[fallthrough]];  // the launch reads it too: the layout checks below
      }
      default: {  // the launch reads the mask's bytes: bool [batch, seq_len], contiguous, aligned
        if (!mask.has_value()) return py::none();
        const at::Tensor& m = *mask;
        if (m.device() != device_ || m.scalar_type() != at::kBool || m.dim() != 2 || m.size(0) != sizes_[0] ||
            m.size(1) != sizes_[1] || !m.is_contiguous() || (mask_mode_ == kInferenceMask && !m.is_inference()))
          return py::none();
        mask_pointer = m.const_data_ptr();
        if (!aligned(mask_pointer)) return py::none();
      }
    }
    for (size_t i = 0; i < params_.size(); ++i) {  // a parameter written, moved or retyped since arming
      const auto& p = params_[i];
      if (p.data_ptr() != pointers_[i] || p._version() != versions_[i]) return py::none();
    }
    if (device_.is_cuda()) {  // launched on the device's default stream, with that device current
      const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      if (guard->getDevice().index() != device_.index() || guard->getStream(device_).id() != 0) return py::none();
    }
    // The kernel reads and writes kernel_dtype_: another x dtype is cast in and the output cast back, as
    // the Python path does (bridge/direct.py, Call.upcast_to).
    const at::Tensor xf = dtype_ == kernel_dtype_ ? x : x.to(kernel_dtype_);
    at::Tensor y = at::empty(sizes_, xf.options());
    int64_t i = 0;
    buffers_[i++] = const_cast<void*>(xf.const_data_ptr());
    if (mask_pointer != nullptr) buffers_[i++] = const_cast<void*>(mask_pointer);
    for (const auto& w : weights_) buffers_[i++] = const_cast<void*>(w.const_data_ptr());
    buffers_[i++] = y.data_ptr();
    if (form_ == 4) {
      // The workspace: allocated per call on the current (default) stream, as the Python path's is.
      const at::Tensor workspace = at::empty({std::max<int64_t>(workspace_bytes_, 1)}, xf.options().dtype(at::kByte));
      buffers_[i++] = workspace.data_ptr();
      launch_kernels();
    } else if (form_ == 3) {
      reinterpret_cast<void (*)(void*, void*, void*)>(entry_)(reinterpret_cast<void*>(entry_args_[0]),
                                                             reinterpret_cast<void*>(entry_args_[1]), buffers_.data());
    } else {
      reinterpret_cast<void (*)(void*)>(entry_)(form1_args_.data());
    }
    if (mask_mode_ == kKeptMaskRows) y = at::where(mask->unsqueeze(-1), y, 0.0);   // as direct.py's "rows" run
    return py::cast(dtype_ == kernel_dtype_ ? y : y.to(dtype_));
  }

 private:
  void set_kernels(std::vector<KernelLaunch> kernels, std::vector<std::pair<int64_t, int64_t>> refs,
                   int64_t workspace_bytes) {
    if (kernels.empty()) throw std::invalid_argument("form 4 needs kernels");
    if (workspace_bytes < 0) throw std::invalid_argument("a negative workspace");
    workspace_bytes_ = workspace_bytes;
    for (const auto& ref : refs)
      if (ref.first < 0 || ref.first >= static_cast<int64_t>(buffers_.size()) || ref.second < 0)
        throw std::invalid_argument("a kernel array outside the call's buffers");
    refs_ = std::move(refs);
    values_.assign(refs_.size() + 1, 0);  // the last slot stays 0: the null of Triton's scratch parameters
    for (const auto& k : kernels) {
      std::vector<void*> params;
      for (int64_t slot : std::get<6>(k)) {
        if (slot < -1 || slot >= static_cast<int64_t>(refs_.size()))
          throw std::invalid_argument("a kernel parameter outside the call's arrays");
        params.push_back(static_cast<void*>(&values_[slot < 0 ? refs_.size() : static_cast<size_t>(slot)]));
      }
      launches_.push_back({std::get<0>(k), std::get<1>(k), std::get<2>(k), std::get<3>(k), std::get<4>(k),
                           std::get<5>(k), std::move(params)});
    }
  }

  // Triton's kernels on the default stream through cuLaunchKernel (entry_), each reading its arrays'
  // addresses from values_ (a buffer plus an offset into it).
  void launch_kernels() {
    for (size_t k = 0; k < refs_.size(); ++k)
      values_[k] = reinterpret_cast<uint64_t>(buffers_[static_cast<size_t>(refs_[k].first)]) +
                   static_cast<uint64_t>(refs_[k].second);
    using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                             void**);
    const auto launch = reinterpret_cast<LaunchFn>(entry_);
    for (auto& l : launches_) {
      const int status = launch(reinterpret_cast<void*>(l.function), l.grid_x, l.grid_y, l.grid_z, l.block_x, 1, 1,
                                l.shared_bytes, nullptr, l.params.data(), nullptr);
      if (status != 0) throw std::runtime_error("cuLaunchKernel failed with CUDA error " + std::to_string(status));
    }
  }

  struct Launch {
    uint64_t function;
    unsigned grid_x, grid_y, grid_z, block_x, shared_bytes;
    std::vector<void*> params;  // pointers into values_
  };

  std::vector<int64_t> sizes_;
  at::ScalarType dtype_;         // x's dtype: kernel_dtype_, or one the call casts to it and back
  at::ScalarType kernel_dtype_;  // the dtype the launch reads and writes (float32 unless given)
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> weights_;
  int mask_mode_;
  std::optional<WeakImpl> kept_mask_;
  int64_t kept_version_ = 0;
  std::vector<int64_t> kept_sizes_;
  at::ScalarType kept_dtype_ = at::kBool;
  uint64_t entry_;
  int form_;
  std::vector<uint64_t> entry_args_;
  // The kernel's pointers, this lane's own (the Python path's launcher has its buffer: neither can
  // overwrite the other's between writing and launching), and form 1's argument array pointing at them.
  std::vector<void*> buffers_;
  void* buffers_pointer_ = nullptr;
  std::vector<void*> form1_args_;
  // Form 4: the kernels, their arrays ((buffer index, byte offset) per parameter slot), the workspace size.
  std::vector<Launch> launches_;
  std::vector<std::pair<int64_t, int64_t>> refs_;
  std::vector<uint64_t> values_;
  int64_t workspace_bytes_ = 0;
  py::object keep_alive_;  // what owns the entry and the buffer memory (the MosaicLauncher; the loaded kernels)
  at::Device device_{at::kCPU};
  std::vector<const void*> pointers_;
  std::vector<int64_t> versions_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Lane>(m, "Lane")
      .def(py::init<std::vector<int64_t>, at::ScalarType, std::vector<at::Tensor>, std::vector<at::Tensor>, int,
                    std::optional<at::Tensor>, uint64_t, int, std::vector<uint64_t>, int64_t, py::object,
                    std::vector<KernelLaunch>, std::vector<std::pair<int64_t, int64_t>>, int64_t,
                    std::optional<at::ScalarType>>(),
           py::arg("sizes"), py::arg("dtype"), py::arg("params"), py::arg("weights"), py::arg("mask_mode"), py::arg("kept_mask"),
           py::arg("entry"), py::arg("form"), py::arg("entry_args"), py::arg("num_buffers"),
           py::arg("keep_alive"), py::arg("kernels") = std::vector<KernelLaunch>(),
           py::arg("refs") = std::vector<std::pair<int64_t, int64_t>>(), py::arg("workspace_bytes") = 0,
           py::arg("kernel_dtype") = py::none())
      .def("run", &Lane::run, py::arg("x"), py::arg("mask") = py::none());
}
