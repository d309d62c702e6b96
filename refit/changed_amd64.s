#include "textflag.h"

// Each step compares 64 bytes of old and new as 16-bit lanes (VPCMPEQW:
// all ones where equal), packs the two halves' lanes to bytes (VPACKSSWB
// interleaves them by 128-bit lane; VPERMQ puts elements 0-31 in order)
// and takes one bit a byte (VPMOVMSKB): inverted, bit j is set when
// element j changed, the bitmap form's layout for 32 elements.

// func changedBitmapAVX2(bm, old, new []byte) int
// len(new) is a multiple of 64, old as long, bm at least len(new)/16 bytes.
TEXT ·changedBitmapAVX2(SB), NOSPLIT, $0-80
	MOVQ bm_base+0(FP), DI
	MOVQ old_base+24(FP), SI
	MOVQ new_base+48(FP), DX
	MOVQ new_len+56(FP), CX
	XORQ AX, AX
	SHRQ $6, CX
	JZ   bitmapdone

bitmaploop:
	VMOVDQU   (SI), Y0
	VMOVDQU   32(SI), Y1
	VPCMPEQW  (DX), Y0, Y0
	VPCMPEQW  32(DX), Y1, Y1
	VPACKSSWB Y1, Y0, Y0
	VPERMQ    $0xd8, Y0, Y0
	VPMOVMSKB Y0, BX
	NOTL      BX
	MOVL      BX, (DI)
	POPCNTL   BX, BX
	ADDQ      BX, AX
	ADDQ      $64, SI
	ADDQ      $64, DX
	ADDQ      $4, DI
	DECQ      CX
	JNZ       bitmaploop

bitmapdone:
	VZEROUPPER
	MOVQ AX, ret+72(FP)
	RET
