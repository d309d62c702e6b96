package cuda

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// ccall calls the C function fn with integer and pointer arguments and
// returns its int result (a CUresult or nvrtcResult). The directive makes
// every pointer converted to uintptr in a call's argument list escape to the
// heap and stay alive until the call returns, as purego.SyscallN requires.
//
//go:uintptrescapes
func ccall(fn uintptr, args ...uintptr) Result {
	r, _, _ := purego.SyscallN(fn, args...)
	return Result(int32(uint32(r))) // C int: the upper half of the register is undefined
}

// sym is one symbol to resolve: the address lands in *p. alt is tried when
// name is missing (an older or newer spelling of the same ABI).
type sym struct {
	p        *uintptr
	name     string
	alt      string
	optional bool // missing from older drivers: left 0
}

func dlopen(path string) (uintptr, error) {
	return purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
}

func resolve(h uintptr, lib string, syms []sym) error {
	for _, s := range syms {
		p, err := purego.Dlsym(h, s.name)
		if err != nil && s.alt != "" {
			p, err = purego.Dlsym(h, s.alt)
		}
		if err != nil && s.optional {
			continue
		}
		if err != nil {
			return fmt.Errorf("cuda: dlsym %s in %s: %v", s.name, lib, err)
		}
		*s.p = p
	}
	return nil
}

// goString reads a NUL-terminated C string.
func goString(p *byte) string {
	if p == nil {
		return ""
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}

// cString returns s as a NUL-terminated byte slice.
func cString(s string) []byte {
	b := make([]byte, len(s)+1)
	copy(b, s)
	return b
}

// driver holds the resolved driver API. Names are the exact exported symbols;
// versioned ones (_v2) are the ABI the current headers map the plain names to.
type driver struct {
	path string

	cuInit, cuDriverGetVersion, cuGetErrorName, cuGetErrorString                           uintptr
	cuDeviceGet, cuDeviceGetCount, cuDeviceGetName, cuDeviceGetAttribute                   uintptr
	cuDeviceTotalMem, cuMemGetInfo                                                         uintptr
	cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRelease, cuCtxSetCurrent                   uintptr
	cuCtxSynchronize                                                                       uintptr
	cuMemAlloc, cuMemFree, cuMemcpyHtoD, cuMemcpyDtoH, cuMemcpyDtoD                        uintptr
	cuMemcpyHtoDAsync, cuMemcpyDtoHAsync, cuMemsetD8, cuMemHostAlloc, cuMemFreeHost        uintptr
	cuMemcpyDtoDAsync                                                                      uintptr
	cuStreamCreate, cuStreamDestroy, cuStreamSynchronize                                   uintptr
	cuEventCreate, cuEventRecord, cuEventSynchronize, cuEventElapsedTime                   uintptr
	cuEventDestroy                                                                         uintptr
	cuEventRecordWithFlags                                                                 uintptr
	cuModuleLoadData, cuModuleGetFunction, cuModuleUnload, cuFuncSetAttribute              uintptr
	cuLaunchKernel, cuLaunchCooperativeKernel, cuOccupancyMaxActiveBlocksPerMultiprocessor uintptr
	cuLaunchKernelEx                                                                       uintptr // 0 where the driver lacks it
	cuStreamBeginCapture, cuStreamEndCapture, cuGraphInstantiateWithFlags                  uintptr
	cuGraphLaunch, cuGraphExecDestroy, cuGraphDestroy                                      uintptr
}

var (
	driversMu sync.Mutex
	drivers   = map[string]*driver{}
)

// loadDriver dlopens the driver library once per path and resolves every
// symbol this package uses. A library that cannot be opened is ErrNoDevice.
func loadDriver(path string) (*driver, error) {
	driversMu.Lock()
	defer driversMu.Unlock()
	if d := drivers[path]; d != nil {
		return d, nil
	}
	h, err := dlopen(path)
	if err != nil {
		return nil, &noDeviceError{fmt.Sprintf("cuda: dlopen %s: %v", path, err)}
	}
	d := &driver{path: path}
	err = resolve(h, path, []sym{
		{p: &d.cuInit, name: "cuInit"},
		{p: &d.cuDriverGetVersion, name: "cuDriverGetVersion"},
		{p: &d.cuGetErrorName, name: "cuGetErrorName"},
		{p: &d.cuGetErrorString, name: "cuGetErrorString"},
		{p: &d.cuDeviceGet, name: "cuDeviceGet"},
		{p: &d.cuDeviceGetCount, name: "cuDeviceGetCount"},
		{p: &d.cuDeviceGetName, name: "cuDeviceGetName"},
		{p: &d.cuDeviceGetAttribute, name: "cuDeviceGetAttribute"},
		{p: &d.cuDeviceTotalMem, name: "cuDeviceTotalMem_v2"},
		{p: &d.cuMemGetInfo, name: "cuMemGetInfo_v2"},
		{p: &d.cuDevicePrimaryCtxRetain, name: "cuDevicePrimaryCtxRetain"},
		{p: &d.cuDevicePrimaryCtxRelease, name: "cuDevicePrimaryCtxRelease_v2", alt: "cuDevicePrimaryCtxRelease"},
		{p: &d.cuCtxSetCurrent, name: "cuCtxSetCurrent"},
		// The plain name: cuCtxSynchronize_v2 exists in newer drivers but
		// takes an explicit context.
		{p: &d.cuCtxSynchronize, name: "cuCtxSynchronize"},
		{p: &d.cuMemAlloc, name: "cuMemAlloc_v2"},
		{p: &d.cuMemFree, name: "cuMemFree_v2"},
		{p: &d.cuMemcpyHtoD, name: "cuMemcpyHtoD_v2"},
		{p: &d.cuMemcpyDtoH, name: "cuMemcpyDtoH_v2"},
		{p: &d.cuMemcpyDtoD, name: "cuMemcpyDtoD_v2"},
		{p: &d.cuMemcpyHtoDAsync, name: "cuMemcpyHtoDAsync_v2"},
		{p: &d.cuMemcpyDtoHAsync, name: "cuMemcpyDtoHAsync_v2"},
		{p: &d.cuMemcpyDtoDAsync, name: "cuMemcpyDtoDAsync_v2"},
		{p: &d.cuMemsetD8, name: "cuMemsetD8_v2"},
		{p: &d.cuMemHostAlloc, name: "cuMemHostAlloc"},
		{p: &d.cuMemFreeHost, name: "cuMemFreeHost"},
		{p: &d.cuStreamCreate, name: "cuStreamCreate"},
		{p: &d.cuStreamDestroy, name: "cuStreamDestroy_v2"},
		{p: &d.cuStreamSynchronize, name: "cuStreamSynchronize"},
		{p: &d.cuEventCreate, name: "cuEventCreate"},
		{p: &d.cuEventRecord, name: "cuEventRecord"},
		{p: &d.cuEventRecordWithFlags, name: "cuEventRecordWithFlags"},
		{p: &d.cuEventSynchronize, name: "cuEventSynchronize"},
		// CUDA 13 headers expose only _v2 (same signature); older drivers
		// export only the plain name.
		{p: &d.cuEventElapsedTime, name: "cuEventElapsedTime_v2", alt: "cuEventElapsedTime"},
		{p: &d.cuEventDestroy, name: "cuEventDestroy_v2"},
		{p: &d.cuModuleLoadData, name: "cuModuleLoadData"},
		{p: &d.cuModuleGetFunction, name: "cuModuleGetFunction"},
		{p: &d.cuModuleUnload, name: "cuModuleUnload"},
		{p: &d.cuFuncSetAttribute, name: "cuFuncSetAttribute"},
		{p: &d.cuLaunchKernel, name: "cuLaunchKernel"},
		{p: &d.cuLaunchCooperativeKernel, name: "cuLaunchCooperativeKernel"},
		{p: &d.cuLaunchKernelEx, name: "cuLaunchKernelEx", optional: true},
		{p: &d.cuOccupancyMaxActiveBlocksPerMultiprocessor, name: "cuOccupancyMaxActiveBlocksPerMultiprocessor"},
		{p: &d.cuStreamBeginCapture, name: "cuStreamBeginCapture_v2"},
		{p: &d.cuStreamEndCapture, name: "cuStreamEndCapture"},
		{p: &d.cuGraphInstantiateWithFlags, name: "cuGraphInstantiateWithFlags"},
		{p: &d.cuGraphLaunch, name: "cuGraphLaunch"},
		{p: &d.cuGraphExecDestroy, name: "cuGraphExecDestroy"},
		{p: &d.cuGraphDestroy, name: "cuGraphDestroy"},
	})
	if err != nil {
		return nil, err
	}
	drivers[path] = d
	return d, nil
}

// names asks the driver for a result code's name and description.
func (d *driver) names(r Result) (name, desc string) {
	var pn, pd *byte
	if ccall(d.cuGetErrorName, uintptr(r), uintptr(unsafe.Pointer(&pn))) == Success {
		name = goString(pn)
	}
	if ccall(d.cuGetErrorString, uintptr(r), uintptr(unsafe.Pointer(&pd))) == Success {
		desc = goString(pd)
	}
	return name, desc
}

// err builds the error for a failed driver call.
func (d *driver) err(call string, r Result, args ...any) error {
	var namer func(Result) (string, string)
	if d != nil {
		namer = d.names
	}
	return newError(namer, call, r, args...)
}

// nvrtcLib holds the resolved NVRTC API.
type nvrtcLib struct {
	path string

	nvrtcVersion, nvrtcGetErrorString, nvrtcCreateProgram, nvrtcCompileProgram   uintptr
	nvrtcGetProgramLogSize, nvrtcGetProgramLog, nvrtcGetCUBINSize, nvrtcGetCUBIN uintptr
	nvrtcDestroyProgram, nvrtcAddNameExpression, nvrtcGetLoweredName             uintptr

	errorString func(int32) string // nvrtcGetErrorString, bound by purego

	major, minor int
}

var (
	nvrtcMu   sync.Mutex
	nvrtcLibs = map[string]*nvrtcLib{}
)

// loadNVRTC opens the first library of paths that loads.
func loadNVRTC(paths []string) (*nvrtcLib, error) {
	nvrtcMu.Lock()
	defer nvrtcMu.Unlock()
	var errs []string
	for _, path := range paths {
		if l := nvrtcLibs[path]; l != nil {
			return l, nil
		}
		h, err := dlopen(path)
		if err != nil {
			errs = append(errs, fmt.Sprintf("dlopen %s: %v", path, err))
			continue
		}
		l := &nvrtcLib{path: path}
		if err := resolve(h, path, []sym{
			{p: &l.nvrtcVersion, name: "nvrtcVersion"},
			{p: &l.nvrtcGetErrorString, name: "nvrtcGetErrorString"},
			{p: &l.nvrtcCreateProgram, name: "nvrtcCreateProgram"},
			{p: &l.nvrtcCompileProgram, name: "nvrtcCompileProgram"},
			{p: &l.nvrtcGetProgramLogSize, name: "nvrtcGetProgramLogSize"},
			{p: &l.nvrtcGetProgramLog, name: "nvrtcGetProgramLog"},
			{p: &l.nvrtcGetCUBINSize, name: "nvrtcGetCUBINSize"},
			{p: &l.nvrtcGetCUBIN, name: "nvrtcGetCUBIN"},
			{p: &l.nvrtcDestroyProgram, name: "nvrtcDestroyProgram"},
			{p: &l.nvrtcAddNameExpression, name: "nvrtcAddNameExpression"},
			{p: &l.nvrtcGetLoweredName, name: "nvrtcGetLoweredName"},
		}); err != nil {
			return nil, err
		}
		purego.RegisterFunc(&l.errorString, l.nvrtcGetErrorString)
		var major, minor int32
		if r := ccall(l.nvrtcVersion, uintptr(unsafe.Pointer(&major)), uintptr(unsafe.Pointer(&minor))); r != Success {
			return nil, l.err("nvrtcVersion", r)
		}
		l.major, l.minor = int(major), int(minor)
		nvrtcLibs[path] = l
		return l, nil
	}
	return nil, fmt.Errorf("cuda: no NVRTC library: %s", joinErrs(errs))
}

func joinErrs(errs []string) string {
	s := ""
	for i, e := range errs {
		if i > 0 {
			s += "; "
		}
		s += e
	}
	return s
}

// nvrtcNames names nvrtcResult codes when the library cannot.
var nvrtcNames = map[Result]string{
	0:  "NVRTC_SUCCESS",
	1:  "NVRTC_ERROR_OUT_OF_MEMORY",
	2:  "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
	3:  "NVRTC_ERROR_INVALID_INPUT",
	4:  "NVRTC_ERROR_INVALID_PROGRAM",
	5:  "NVRTC_ERROR_INVALID_OPTION",
	6:  "NVRTC_ERROR_COMPILATION",
	7:  "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
	11: "NVRTC_ERROR_INTERNAL_ERROR",
}

// err builds the error for a failed NVRTC call.
func (l *nvrtcLib) err(call string, r Result, args ...any) error {
	return newError(func(r Result) (string, string) {
		if l != nil && l.errorString != nil {
			if s := l.errorString(int32(r)); s != "" {
				return s, ""
			}
		}
		if n, ok := nvrtcNames[r]; ok {
			return n, ""
		}
		return fmt.Sprintf("nvrtcResult(%d)", int32(r)), ""
	}, call, r, args...)
}
