package cuda

import (
	"errors"
	"fmt"
	"strings"
)

// ErrNoDevice is wrapped by every error that means "no usable CUDA device
// here": the driver library cannot be loaded, the driver reports no device,
// or the configured ordinal does not exist. Tests that need a GPU skip on it:
//
//	if errors.Is(err, cuda.ErrNoDevice) { t.Skip("no CUDA device: " + err.Error()) }
var ErrNoDevice = errors.New("cuda: no CUDA device")

// ErrClosed is returned by Device.Do after Close.
var ErrClosed = errors.New("cuda: device is closed")

// ErrWrongThread is returned by a Ctx method (or a method of an object made
// by one) that is called outside the function passed to Device.Do: only the
// owner thread may touch the CUDA context.
var ErrWrongThread = errors.New("cuda: context used outside Device.Do (not on the owner thread)")

// ErrCapturing is returned by a synchronous memory operation, an allocation
// or a stream synchronisation issued while a stream is being captured into a
// graph: the driver would invalidate the capture.
var ErrCapturing = errors.New("cuda: not allowed during stream capture")

// Result is a CUresult of the driver API. 0 is success.
type Result int32

// Result codes referred to by this package.
const (
	Success                   Result = 0
	ErrorInvalidValue         Result = 1
	ErrorOutOfMemory          Result = 2
	ErrorNotInitialized       Result = 3
	ErrorStubLibrary          Result = 34
	ErrorDeviceUnavailable    Result = 46
	ErrorNoDevice             Result = 100
	ErrorInvalidDevice        Result = 101
	ErrorSystemDriverMismatch Result = 803
	ErrorCompatNotSupported   Result = 804
)

// resultNames backs error messages when the driver cannot name a code (the
// library is not loaded, or the code is unknown to it). Descriptions follow
// cuGetErrorString where known.
var resultNames = map[Result][2]string{
	0:   {"CUDA_SUCCESS", "no error"},
	1:   {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	2:   {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
	3:   {"CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	4:   {"CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
	34:  {"CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
	46:  {"CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
	100: {"CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	101: {"CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
	200: {"CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
	201: {"CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
	209: {"CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
	218: {"CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
	222: {"CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain."},
	400: {"CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
	401: {"CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
	500: {"CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	600: {"CUDA_ERROR_NOT_READY", "device not ready"},
	700: {"CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
	701: {"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
	702: {"CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
	710: {"CUDA_ERROR_ASSERT", "device-side assert triggered"},
	715: {"CUDA_ERROR_ILLEGAL_INSTRUCTION", "an illegal instruction was encountered"},
	716: {"CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"},
	719: {"CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
	800: {"CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
	801: {"CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	803: {"CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
	804: {"CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "forward compatibility was attempted on non supported HW"},
	900: {"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
	901: {"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
	906: {"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "operation would make the legacy stream depend on a capturing blocking stream"},
	908: {"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
	999: {"CUDA_ERROR_UNKNOWN", "unknown error"},
}

// noDeviceResults are the codes that mean no usable device is present.
func (r Result) noDevice() bool {
	switch r {
	case ErrorNoDevice, ErrorInvalidDevice, ErrorStubLibrary, ErrorDeviceUnavailable,
		ErrorSystemDriverMismatch, ErrorCompatNotSupported:
		return true
	}
	return false
}

// Error is a failed driver or NVRTC call.
type Error struct {
	Call string // the C function, e.g. "cuMemAlloc_v2"
	Args string // its arguments as formatted in the message, may be empty
	Code Result // the CUresult (or nvrtcResult for NVRTC calls)
	Name string // e.g. "CUDA_ERROR_OUT_OF_MEMORY"
	Desc string // e.g. "out of memory"; may be empty
}

// Error formats as `cuda: CALL(ARGS): NAME (DESC)`.
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("cuda: ")
	b.WriteString(e.Call)
	b.WriteByte('(')
	b.WriteString(e.Args)
	b.WriteString("): ")
	b.WriteString(e.Name)
	if e.Desc != "" {
		b.WriteString(" (")
		b.WriteString(e.Desc)
		b.WriteByte(')')
	}
	return b.String()
}

// Is reports ErrNoDevice for the result codes that mean no usable device.
func (e *Error) Is(target error) bool {
	return target == ErrNoDevice && !strings.HasPrefix(e.Call, "nvrtc") && e.Code.noDevice()
}

// newError builds the error for a failed call. name and desc come from the
// driver when it can name the code (namer may be nil), else from the table.
func newError(namer func(Result) (string, string), call string, r Result, args ...any) *Error {
	e := &Error{Call: call, Code: r, Args: formatArgs(args)}
	if namer != nil {
		e.Name, e.Desc = namer(r)
	}
	if e.Name == "" {
		if n, ok := resultNames[r]; ok {
			e.Name = n[0]
			if e.Desc == "" {
				e.Desc = n[1]
			}
		} else {
			e.Name = fmt.Sprintf("CUresult(%d)", int32(r))
		}
	}
	return e
}

func formatArgs(args []any) string {
	if len(args) == 0 {
		return ""
	}
	var b strings.Builder
	for i, a := range args {
		if i > 0 {
			b.WriteString(", ")
		}
		switch v := a.(type) {
		case string:
			b.WriteString(v) // names are passed preformatted
		default:
			fmt.Fprint(&b, v)
		}
	}
	return b.String()
}

// noDeviceError is returned when the driver library cannot be loaded or
// reports no device; it matches ErrNoDevice.
type noDeviceError struct{ msg string }

func (e *noDeviceError) Error() string        { return e.msg }
func (e *noDeviceError) Is(target error) bool { return target == ErrNoDevice }

// CompileError is a failed NVRTC compilation; Log holds the compiler output.
type CompileError struct {
	Name string // the program name, e.g. "vecadd.cu"
	Err  error  // the failed NVRTC call
	Log  string
}

func (e *CompileError) Error() string {
	msg := fmt.Sprintf("cuda: compile %s: %s", e.Name, strings.TrimPrefix(e.Err.Error(), "cuda: "))
	if log := strings.TrimSpace(e.Log); log != "" {
		msg += "\n" + log
	}
	return msg
}

func (e *CompileError) Unwrap() error { return e.Err }
