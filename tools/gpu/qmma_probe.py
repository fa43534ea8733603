"""Microbenchmark: stream a Q4-like nibble matrix (rows x K, 16 bytes per 32-element unit) through
(a) a plain read, (b) bf16 mma.m16n8k16 with levels placed by the magic-number trick, 4-byte loads per row-unit
(the current layout), (c) the same with 16-byte loads (4 units' lane words transposed). Prints GB/s."""
import sys, time
import cupy as cp
SRC = r'''
typedef unsigned int u32;
__device__ __forceinline__ u32 lop(u32 a, u32 m, u32 c){u32 d; asm("lop3.b32 %0,%1,%2,%3,0xEA;":"=r"(d):"r"(a),"r"(m),"r"(c)); return d;}
__device__ __forceinline__ void mma(float (&d)[4], u32 a0,u32 a1,u32 a2,u32 a3,u32 b0,u32 b1){
 asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3},{%4,%5,%6,%7},{%8,%9},{%0,%1,%2,%3};"
  :"+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]):"r"(a0),"r"(a1),"r"(a2),"r"(a3),"r"(b0),"r"(b1));}
extern "C" __global__ void __launch_bounds__(384,1) rd(const uint4* w, long n, float* out){
  u32 s=0; for(long i=blockIdx.x*384+threadIdx.x;i<n;i+=(long)gridDim.x*384){uint4 v=__ldcs(w+i); s^=v.x^v.y^v.z^v.w;}
  if(s==0x12345) out[0]=s;}
// rows x K/32 units, row stride K/2 bytes. Warp item = 16 rows x U units.
template<int WIDE> __device__ void mm(const unsigned char* w, int rows, int K, const float* sc, float* out){
  const int lane=threadIdx.x&31, g=lane>>2, t=lane&3; const int nun=K/32;
  const int warps=gridDim.x*12, wid=blockIdx.x*12+(threadIdx.x>>5);
  __shared__ uint4 xs[5120/8];
  for(int i=threadIdx.x;i<K/8;i+=384) xs[i]=make_uint4(0x3f803f80u+i,0x3f80u,0x3f803f80u,0x3f80u);
  __syncthreads();
  const u32 M=0x000F000Fu, C=0x43004300u;
  float tot=0.f;
  for(int tile=wid; tile<rows/16; tile+=warps){
    const unsigned char* r0=w+(long)(tile*16+g)*(K/2); const unsigned char* r1=r0+(long)8*(K/2);
    float acc[4]={0,0,0,0};
    #pragma unroll 1
    for(int v0=0; v0<nun; v0+=8){
      u32 wa[8], wb[8];
      if(WIDE){ uint4 a=__ldcs((const uint4*)(r0+v0*16+t*16)), b=__ldcs((const uint4*)(r0+v0*16+64+t*16));
        uint4 c=__ldcs((const uint4*)(r1+v0*16+t*16)), d=__ldcs((const uint4*)(r1+v0*16+64+t*16));
        wa[0]=a.x;wa[1]=a.y;wa[2]=a.z;wa[3]=a.w;wa[4]=b.x;wa[5]=b.y;wa[6]=b.z;wa[7]=b.w;
        wb[0]=c.x;wb[1]=c.y;wb[2]=c.z;wb[3]=c.w;wb[4]=d.x;wb[5]=d.y;wb[6]=d.z;wb[7]=d.w;}
      else {
        #pragma unroll
        for(int j=0;j<8;++j){wa[j]=__ldcs((const u32*)(r0+(v0+j)*16+4*t)); wb[j]=__ldcs((const u32*)(r1+(v0+j)*16+4*t));}}
      const float4 s4a=__ldg((const float4*)(sc+(long)(tile*16+g)*nun/8*0+v0/8*4));
      #pragma unroll
      for(int j=0;j<8;++j){
        const uint4 xq=xs[(v0+j)*4+t];
        u32 b00,b01,b10,b11;
        asm("prmt.b32 %0,%1,%2,0x5410;":"=r"(b00):"r"(xq.x),"r"(xq.z)); asm("prmt.b32 %0,%1,%2,0x7632;":"=r"(b01):"r"(xq.x),"r"(xq.z));
        asm("prmt.b32 %0,%1,%2,0x5410;":"=r"(b10):"r"(xq.y),"r"(xq.w)); asm("prmt.b32 %0,%1,%2,0x7632;":"=r"(b11):"r"(xq.y),"r"(xq.w));
        float d[4]={0,0,0,0};
        const u32 a=wa[j], b=wb[j];
        mma(d, lop(a,M,C), lop(b,M,C), lop(a>>4,M,C), lop(b>>4,M,C), b00, b01);
        mma(d, lop(a>>8,M,C), lop(b>>8,M,C), lop(a>>12,M,C), lop(b>>12,M,C), b10, b11);
        const float sa=(&s4a.x)[j&3];
        acc[0]=fmaf(sa,d[0],acc[0]); acc[2]=fmaf(sa,d[2],acc[2]);
        acc[0]=fmaf(-sa,1.f,acc[0]); acc[2]=fmaf(-sa,1.f,acc[2]);
        if(NT>1){acc[1]=fmaf(sa,d[1],acc[1]); acc[3]=fmaf(sa,d[3],acc[3]);}
      }
    }
    tot+=acc[0]+acc[1]+acc[2]+acc[3];
  }
  if(tot==1.2345f) out[0]=tot;
}
extern "C" __global__ void __launch_bounds__(384,1) mm4(const unsigned char* w,int rows,int K,const float* sc,float* out){mm<0>(w,rows,K,sc,out);}
extern "C" __global__ void __launch_bounds__(384,1) mm16(const unsigned char* w,int rows,int K,const float* sc,float* out){mm<1>(w,rows,K,sc,out);}
'''
K, rows = 5120, 17408 * 8
nt = int(sys.argv[1]) if len(sys.argv) > 1 else 1
mod = cp.RawModule(code=SRC.replace("NT>1", f"{nt}>1"), options=("--std=c++17", "-arch=sm_90"))
w = cp.random.randint(0, 2**31, size=rows * K // 8, dtype=cp.int32).view(cp.uint8)
sc = cp.ones(rows * K // 32, dtype=cp.float32)
out = cp.zeros(4, cp.float32)
nbytes = w.nbytes
def timeit(name, f):
    f(); cp.cuda.runtime.deviceSynchronize()
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    ev0.record(); n = 10
    for _ in range(n): f()
    ev1.record(); ev1.synchronize()
    ms = cp.cuda.get_elapsed_time(ev0, ev1) / n
    print(f"{name}: {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s", flush=True)
timeit("plain read", lambda: mod.get_function("rd")((132,), (384,), (w, cp.int64(nbytes // 16), out)))
timeit(f"mma LDG.32 T={nt}", lambda: mod.get_function("mm4")((132,), (384,), (w, cp.int32(rows), cp.int32(K), sc, out)))
timeit(f"mma LDG.128 T={nt}", lambda: mod.get_function("mm16")((132,), (384,), (w, cp.int32(rows), cp.int32(K), sc, out)))
