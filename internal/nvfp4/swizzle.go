package nvfp4

import "fmt"

// SwizzledDims returns the padded geometry of the 128x4-swizzled block-scale
// layout for a matrix with rows rows and blocks scales per row:
// rowsP = ceil(rows/128)*128 and colsP = ceil(blocks/4)*4.
func SwizzledDims(rows, blocks int) (rowsP, colsP int) {
	return (rows + 127) / 128 * 128, (blocks + 3) / 4 * 4
}

// SwizzleOffset is the byte offset of block scale (m, k) in the 128x4
// swizzled layout whose padded column count is colsP (docs/NVFP4.md section 6).
func SwizzleOffset(m, k, colsP int) int {
	return (m/128)*(colsP/4)*512 + (k/4)*512 + (m%32)*16 + ((m%128)/32)*4 + k%4
}

// Swizzle rearranges linear row-major block scales (rows x blocks) into the
// 128x4 swizzled layout. dst must hold rowsP*colsP bytes; padding bytes are 0.
func Swizzle(dst, linear []byte, rows, blocks int) error {
	rowsP, colsP := SwizzledDims(rows, blocks)
	if len(dst) != rowsP*colsP || len(linear) != rows*blocks {
		return fmt.Errorf("nvfp4: swizzle %dx%d: got %d linear and %d swizzled bytes, want %d and %d",
			rows, blocks, len(linear), len(dst), rows*blocks, rowsP*colsP)
	}
	clear(dst)
	for m := range rows {
		for k := range blocks {
			dst[SwizzleOffset(m, k, colsP)] = linear[m*blocks+k]
		}
	}
	return nil
}

// Unswizzle is the inverse of Swizzle: it reads the rows x blocks scales back
// out of the swizzled bytes into linear row-major order.
func Unswizzle(linear, src []byte, rows, blocks int) error {
	rowsP, colsP := SwizzledDims(rows, blocks)
	if len(src) != rowsP*colsP || len(linear) != rows*blocks {
		return fmt.Errorf("nvfp4: unswizzle %dx%d: got %d swizzled and %d linear bytes, want %d and %d",
			rows, blocks, len(src), len(linear), rowsP*colsP, rows*blocks)
	}
	for m := range rows {
		for k := range blocks {
			linear[m*blocks+k] = src[SwizzleOffset(m, k, colsP)]
		}
	}
	return nil
}
