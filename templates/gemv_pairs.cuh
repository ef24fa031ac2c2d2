//! lum/templates/gemv_pairs.cuh — gemv.cu's EPILOGUE for a GEMV whose groups each compute NACC output
//! columns, A read once for them (codegen gemv_prologue_pairs): column lum_j + ACC_COLS[t] of every row.
#pragma unroll
        for (int lum_ei = 0; lum_ei < M; ++lum_ei) {
#pragma unroll
          for (int lum_t = 0; lum_t < NACC; ++lum_t) {
            lum_store((lum_b * M + lum_ei) * lum_n + lum_j + ACC_COLS[lum_t], lum_acc[lum_t * M + lum_ei]);
          }
        }
