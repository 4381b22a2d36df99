// t3d._C: the pybind11 module that creates ProcessGroupT3D for torch.distributed and reports build facts.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "device_stream.hpp"
#include "process_group_t3d.hpp"
#include "registered_allocator.hpp"

namespace py = pybind11;

namespace {

// Holder of the Python object: drops the last reference with the GIL released, because destroying the backend
// drains t3d's queue, whose completions may run Python future callbacks on other threads. One intrusive_ptr, like
// the holder torch registers Backend with, so pybind can view it as the base class's holder.
template <typename T>
class NoGilPtr {
 public:
  NoGilPtr() = default;
  NoGilPtr(const NoGilPtr&) = default;
  NoGilPtr(NoGilPtr&&) noexcept = default;
  NoGilPtr& operator=(const NoGilPtr&) = default;
  NoGilPtr& operator=(NoGilPtr&&) noexcept = default;
  explicit NoGilPtr(T* raw) : p_(c10::intrusive_ptr<T>::unsafe_reclaim_from_nonowning(raw)) {}
  explicit NoGilPtr(c10::intrusive_ptr<T> p) : p_(std::move(p)) {}
  ~NoGilPtr() {
    if (p_ && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      p_.reset();
    }
  }
  T* get() const {
    return p_.get();
  }

 private:
  c10::intrusive_ptr<T> p_;
};

t3d_shim::ProcessGroupT3D& asT3D(const c10::intrusive_ptr<c10d::Backend>& backend) {
  auto* pg = dynamic_cast<t3d_shim::ProcessGroupT3D*>(backend.get());
  TORCH_CHECK(pg != nullptr, "t3d: expected a t3d backend, got ", backend ? backend->getBackendName() : "None");
  return *pg;
}

// libt3d's registry of environment variables (t3d_param_get), one dict per variable in declaration order: name,
// type ("int", "str" or "bool"), reader, meaning, default (the value when unset, as text), default_shown (as the
// README shows it), value (int for int and bool, str for str), value_text, env (the environment's text or None),
// set, valid.
py::list paramList() {
  py::list out;
  const int n = t3d_param_count();
  for (int i = 0; i < n; ++i) {
    t3d_param_t p;
    if (t3d_param_get(i, &p) != T3D_OK) continue;
    const char* type = p.type == T3D_PARAM_TYPE_STR ? "str" : p.type == T3D_PARAM_TYPE_BOOL ? "bool" : "int";
    py::dict d;
    d["name"] = p.name;
    d["type"] = type;
    d["reader"] = p.reader;
    d["meaning"] = p.meaning;
    d["default"] = p.default_text;
    d["default_shown"] = p.default_shown;
    d["value"] = p.type == T3D_PARAM_TYPE_STR ? py::object(py::str(p.value_text)) : py::object(py::int_(p.value));
    d["value_text"] = p.value_text;
    d["env"] = p.env_text != nullptr ? py::object(py::str(p.env_text)) : py::object(py::none());
    d["set"] = p.is_set != 0;
    d["valid"] = p.is_valid != 0;
    out.append(d);
  }
  return out;
}

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilPtr<T>, true)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "t3d: torch.distributed backend over the t3d C library";
  // Backend, Store and Work must be registered with pybind before our signatures mention them.
  py::module_::import("torch.distributed");

  // A subclass of torch's Backend, for what torch reads only from concrete classes (split_group reads `options`).
  py::class_<t3d_shim::ProcessGroupT3D, c10d::Backend, NoGilPtr<t3d_shim::ProcessGroupT3D>>(m, "ProcessGroupT3D")
      .def_property_readonly("options", &t3d_shim::ProcessGroupT3D::getBackendOptions)
      .def_property_readonly("transport", &t3d_shim::ProcessGroupT3D::transport)
      .def_property_readonly("group_name", &t3d_shim::ProcessGroupT3D::groupName);

  m.def(
      "_create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeoutSeconds,
         const std::string& groupName, const std::vector<int64_t>& globalRanks) {
        auto ms = std::chrono::milliseconds(static_cast<int64_t>(std::llround(timeoutSeconds * 1000.0)));
        return NoGilPtr<t3d_shim::ProcessGroupT3D>(
            t3d_shim::ProcessGroupT3D::create(store, rank, size, ms, groupName, globalRanks));
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_seconds"), py::arg("group_name"),
      py::arg("global_ranks"),
      // Communicator setup waits on the store for every rank; other Python threads keep running.
      py::call_guard<py::gil_scoped_release>(),
      "Collective over the group: creates the t3d backend (called by the creator registered with torch).");

  m.def(
      "_transport",
      [](const c10::intrusive_ptr<c10d::Backend>& backend) { return asT3D(backend).transport(); },
      "Transport the backend's communicator uses (e.g. 'ucx').");

  m.def(
      "_mem_bytes",
      [](int64_t bytes) -> at::Tensor {
        TORCH_CHECK(bytes >= 0, "t3d.mem: ", bytes, " bytes is negative");
        void* ptr = nullptr;
        const t3d_result_t r = t3d_mem_alloc(static_cast<size_t>(std::max<int64_t>(bytes, 1)), &ptr);
        TORCH_CHECK(r == T3D_OK, "t3d.mem: t3d_mem_alloc of ", bytes, " bytes failed: ", t3d_result_string(r));
        return at::from_blob(ptr, {bytes}, [](void* p) { t3d_mem_free(p); }, at::TensorOptions().dtype(at::kByte));
      },
      py::arg("bytes"), "A uint8 CPU tensor of `bytes` in t3d memory (t3d_mem_alloc): other ranks of the host map it.");
  m.def(
      "_mem_allocator",
      [](bool on, int64_t min_bytes, int64_t cache_bytes) {
        auto& a = t3d_shim::RegisteredAllocator::get();
        if (on) a.enable(static_cast<size_t>(std::max<int64_t>(min_bytes, 1)),
                         static_cast<size_t>(std::max<int64_t>(cache_bytes, 0)));
        else a.disable();
      },
      py::arg("on"), py::arg("min_bytes") = 0, py::arg("cache_bytes") = 0,
      "Routes torch's CPU allocations of at least min_bytes to t3d memory (on), or gives torch back its allocator.");
  m.def("_mem_allocator_stats", []() {
    auto& a = t3d_shim::RegisteredAllocator::get();
    py::dict d;
    d["enabled"] = a.enabled();
    d["live_bytes"] = a.live_bytes();
    d["cached_bytes"] = a.cached_bytes();
    return d;
  });
  m.def("_mem_allocator_empty_cache", []() { t3d_shim::RegisteredAllocator::get().empty_cache(); });
  m.def(
      "_mem_owns", [](uintptr_t ptr, size_t bytes) { return t3d_mem_owns(reinterpret_cast<void*>(ptr), bytes) != 0; },
      py::arg("ptr"), py::arg("bytes"), "Whether [ptr, ptr + bytes) lies in one t3d memory allocation.");

  m.def("_build_info", []() {
    py::dict d;
    d["version"] = t3d_version_string();
    d["torch_built"] = T3D_TORCH_BUILD_VERSION;
    d["torch_abi_version"] = TORCH_VERSION;
    d["ucx_version"] = t3d_ucx_version_string();
    d["features"] = t3d_build_features();
    d["cuda"] = t3d_shim::cudaStreamsAvailable();
    // Loads NCCL if need be: in a CUDA build of torch this is the library torch already loaded.
    const char* nccl = t3d_nccl_version_string();
    d["nccl_version"] = nccl[0] ? py::object(py::str(nccl)) : py::object(py::none());
    d["nccl_error"] = t3d_nccl_load_error();
    d["params"] = paramList();
    return d;
  });

  // The flight recorder (t3d.flight_recorder): the dump is built and written with the GIL released, so a dump
  // never waits on a thread that records while it waits for the GIL (stack capture).
  m.def(
      "_fr_pickled",
      []() {
        std::string data;
        {
          py::gil_scoped_release nogil;
          data = t3d_shim::fr::Recorder::get().pickled();
        }
        return py::bytes(data);
      },
      "The flight recorder's dump, pickled in the format of torch's flight recorder.");
  m.def(
      "_fr_write",
      [](const std::string& path) { return t3d_shim::fr::Recorder::get().writeDump(path); }, py::arg("path") = "",
      py::call_guard<py::gil_scoped_release>(),
      "Writes the dump to path (empty: <TORCH_FR_DUMP_TEMP_FILE><global rank>) and returns the path.");
  m.def("_fr_default_path", []() { return t3d_shim::fr::Recorder::get().defaultPath(); });
  m.def("_fr_buffer_size", []() { return t3d_shim::fr::Recorder::get().capacity(); });
  m.def(
      "_fr_reset", [](size_t n) { t3d_shim::fr::Recorder::get().reset(n); }, py::arg("buffer_size"),
      py::call_guard<py::gil_scoped_release>());
  m.def("_fr_stack_capture", []() { return t3d_shim::fr::Recorder::get().stackCapture(); });
  m.def(
      "_fr_set_stack_capture", [](bool on) { t3d_shim::fr::Recorder::get().setStackCapture(on); }, py::arg("on"));

  m.def("_params", &paramList,
        "The environment variables t3d reads, with their effective values (libt3d's registry, t3d_param_get).");
}
